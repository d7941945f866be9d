"""Which shards each epoch of a run trains on.

A run fixed at launch (the default) trains every epoch on the same shards. With --follow the run
starts while extraction is still committing shards of its --shards range: at each epoch's start
the main process looks at the store's commit files (one listing, then one read of each new
commit file and of its per-sample arrays) and the epoch takes every shard of the range committed
by then; every rank receives that answer, so all of them form the same epoch. Shards join at
epoch starts, not as soon as they commit, because an epoch is one shuffle of a fixed set of
samples: its batches can be dealt to ranks, and a saved position (a set of that shuffle's batch
indices) resumes it on any number of processes; a shard added mid-epoch would change the
shuffle under the batches already read. Early epochs are short (they hold the few shards
committed so far), so shards join often while extraction runs.

The epochs' shard lists are the schedule: saved with every step-N (the data position), so
`--resume` replays exactly the epochs that were read, and written to OUT/shards.json, which
--shard-schedule replays on the finished store.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from stages.out_contents import SCHEDULE
from stages.train.config import ShardScheduleConfig, TrainConfig
from stages.train.main_process import on_main
from stages.train.samples import Refs, refs_of
from store.errors import ConfigError
from store.format.ranges import format_ranges, parse_ranges
from store.hidden_store import HiddenStore
from store.sample_index import per_sample

FILE = SCHEDULE  # OUT/shards.json: every epoch's shards so far (--follow, --shard-schedule)


class ShardSchedule:
    """epoch -> the training Refs of that epoch's shards. `arrays`: the per-sample arrays of every
    shard known so far (shard -> {offsets, first_pairs}); `epochs`: the shard lists decided so far,
    epoch after epoch (empty for a run fixed at launch, whose every epoch is `shards`)."""

    def __init__(
        self,
        config: TrainConfig,
        store: HiddenStore,
        shards: list[int],
        arrays: dict,
        epochs: list[tuple[int, ...]],
        mode: str,
    ) -> None:
        assert mode in ("fixed", "follow", "replay"), mode
        self.config, self.store, self.range, self.arrays = config, store, shards, arrays
        self.epochs, self.mode = list(epochs), mode
        self._refs: dict[tuple[int, ...], Refs] = {}  # one Refs a shard list: its formed epochs are kept on it
        self._looked = 0.0  # when the store was last looked at (--follow)

    def shards(self, epoch: int) -> tuple[int, ...]:
        """The shards epoch `epoch` trains on; it must have been decided (`decide`) unless the run is fixed."""
        if self.mode == "fixed":
            return tuple(self.range)
        return self.epochs[min(epoch, len(self.epochs) - 1)] if self.mode == "replay" else self.epochs[epoch]

    def refs(self, epoch: int) -> Refs:
        key = self.shards(epoch)
        if key not in self._refs:
            if len(self._refs) > 4:  # epochs come in order: the old shard lists are not asked again
                self._refs.pop(next(iter(self._refs)))
            self._refs[key] = refs_of(self.arrays, list(key), self.config.data.max_length)
        return self._refs[key]

    def decide(self, epoch: int, acc) -> None:
        """--follow: fix epoch's shards (every rank calls it at the same point: the main process looks,
        the others receive). Epochs already decided, and runs not following, are left as they are."""
        if self.mode != "follow" or epoch < len(self.epochs):
            return
        assert epoch == len(self.epochs), (epoch, len(self.epochs))
        self._append(acc)
        if acc.is_main_process:
            self.write(Path(self.config.run.out) / FILE)

    def _append(self, acc) -> None:
        """The next epoch's shards: those of the last epoch and every shard of the range committed since."""
        known = set(self.epochs[-1]) if self.epochs else set()
        fresh = (
            time.monotonic() - self._looked >= self.config.shard_schedule.follow_poll
        )  # the main process's clock decides
        new, arrays = on_main(acc, lambda: self._look(known) if fresh else ([], {}))
        self._looked = time.monotonic() if fresh else self._looked
        self.arrays.update(arrays)
        self.epochs.append(tuple(sorted(known | set(new))))

    def _look(self, known: set[int]) -> tuple[list[int], dict]:
        """(the shards of the range committed since `known` was decided, the per-sample arrays of
        those not known at launch): one fresh listing of the commit files, then the commit files and
        arrays of the shards committed since launch only (the launch's index holds the others)."""
        new = sorted((set(self.store.commit_ids(fresh=True)) & set(self.range)) - known)
        records, damaged = self.store.commits([s for s in new if s not in self.arrays])
        if damaged:
            raise next(iter(damaged.values()))
        return [s for s in new if s in self.arrays or s in records], per_sample(self.store, records) if records else {}

    def wait_for_start(self, acc, enough, log) -> None:
        """--follow: decide epoch 0, waiting (one look every --follow-poll seconds) until its
        samples make enough batches (`enough(refs)`) to begin. OUT/shards.json is written once it begins
        (a run interrupted while it waits leaves none)."""
        if self.mode != "follow" or self.epochs:
            return
        while True:
            self._append(acc)
            if enough(self.refs(0)):
                if acc.is_main_process:
                    self.write(Path(self.config.run.out) / FILE)
                return
            if acc.is_main_process:
                log(
                    f"--follow: {len(self.epochs[0])} of the {len(self.range)} shards of --shards "
                    f"{format_ranges(self.range)} committed ({format_ranges(list(self.epochs[0])) or 'none'}), too few "
                    f"to begin; looking again in {self.config.shard_schedule.follow_poll:g} s"
                )
            self.epochs.clear()
            time.sleep(self.config.shard_schedule.follow_poll)

    def unread(self, last: int) -> str:
        """The shards of the range that no epoch up to `last` (the last one the run read from) trains on,
        and why, as the run's last line says it; '' when there are none. Following: committed after
        that epoch began (its shards decided), or not committed when the run ended; replaying: listed
        only in epochs of the schedule the run did not reach, or in none."""
        read = set(self.range) if self.mode == "fixed" else set().union(*map(set, self.epochs[: last + 1]))
        unread = [s for s in self.range if s not in read or last < 0]
        if not unread:
            return ""
        later = set().union(*map(set, self.epochs[last + 1 :]))
        if self.mode == "follow":
            later |= set(self.store.commit_ids(fresh=True))
            why = (f"committed after the last epoch run (epoch {last}) began", "not committed when the run ended")
        else:
            why = ("listed by --shard-schedule only in epochs this run did not reach", "in none of its epochs")
        parts = [
            (format_ranges([s for s in unread if (s in later) == first]), text)
            for first, text in zip((True, False), why)
        ]
        return f"shards {format_ranges(unread)} of --shards never trained on: " + ", ".join(
            f"{shards} {text}" for shards, text in parts if shards
        )

    def to_json(self) -> list[str] | None:
        return None if self.mode == "fixed" else [format_ranges(list(e)) for e in self.epochs]

    def write(self, path: Path) -> None:
        """The schedule so far, replaced atomically (a reader never sees half a file)."""
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({"shards": format_ranges(self.range), "epochs": self.to_json()}, indent=1) + "\n")
        os.replace(tmp, path)


def schedule_of(
    config: TrainConfig, store: HiddenStore, shards: list[int], index, saved: list[str] | None
) -> ShardSchedule:
    """The run's schedule: fixed at launch, following the store (--follow), or replayed
    (--shard-schedule); a resumed run continues from its saved epochs. index: the store's sample
    index at launch (records, arrays)."""
    mode = "follow" if config.shard_schedule.follow else "replay" if config.shard_schedule.shard_schedule else "fixed"
    epochs = saved if saved is not None else read_schedule(config.shard_schedule) if mode == "replay" else []
    epochs = [tuple(parse_ranges(e, store.num_shards, FILE)) for e in epochs]
    listed = sorted(set(shards).union(*map(set, epochs)))
    outside = [s for s in listed if s not in set(shards)]
    if outside:
        raise ConfigError(
            flag_of_schedule(config.shard_schedule),
            config.shard_schedule.shard_schedule or config.run.resume,
            f"lists shards {format_ranges(outside)}, outside --shards {config.data.shards}",
        )
    needed = shards if mode == "fixed" else sorted(set().union(*map(set, epochs)))
    missing = [s for s in needed if s not in index.records]
    if missing:
        store.require_committed(missing)
    arrays = {s: index.arrays[s] for s in listed if s in index.arrays}
    return ShardSchedule(config, store, shards, arrays, epochs, mode)


def read_schedule(config: ShardScheduleConfig) -> list[str]:
    """The epochs of --shard-schedule's file (OUT/shards.json of a --follow run)."""
    path = Path(config.shard_schedule)
    try:
        epochs = json.loads(path.read_text())["epochs"]
    except FileNotFoundError:
        raise ConfigError("--shard-schedule", path, "no such file") from None
    except (ValueError, KeyError, TypeError):
        raise ConfigError("--shard-schedule", path, f"not a schedule ({FILE} of a --follow run)") from None
    if not epochs or not all(isinstance(e, str) for e in epochs):
        raise ConfigError("--shard-schedule", path, "lists no epochs")
    return epochs


def flag_of_schedule(config: ShardScheduleConfig) -> str:
    return "--shard-schedule" if config.shard_schedule else "--resume"
