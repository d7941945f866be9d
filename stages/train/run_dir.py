"""The run directory OUT: metrics.jsonl (and trackers), step-N checkpoints, final/, audit files.

A step checkpoint is a drafter in the public layout plus `training/` (the trainer state: fp32 model,
optimizers, schedules, every rank's RNG, written by every rank at once with torch.distributed.checkpoint,
stages/train/trainer_state.py) and `trainer_state.json`, built in a hidden temporary directory and
published by a rename once every rank's write returned, so a crash never leaves a half checkpoint that
--resume trusts. A checkpoint saved before (`training/` holding Accelerate's save_state and Muon's
momentum shards) still resumes (load_training).
Once one is published, --keep-last K deletes the older ones beyond the newest K (prune_steps).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch

from pipeline import device as devices
from pipeline.drafter import checkpoint
from pipeline.drafter.config import TrainingRecord
from pipeline.errors import TrainingError
from stages import out_dir
from stages.out_contents import RUN, RUN_LOCK, refuse_other_kinds
from stages.paths import full_disk
from stages.settings import flag_of, leaves, with_role
from stages.train import trainer_state
from stages.train.config import RunConfig, TrainConfig
from stages.train.optim import Muon
from stages.train.position import advance, epochs_done, epochs_walked
from store.errors import ConfigError
from store.io import file_modes
from store.io.locks import LockFile

# Fields that fix the data order and the model: a resumed run must keep them.
RESUME_FIXED = tuple(with_role(TrainConfig, "resume"))  # what a resumed run must keep: setting(..., resume="fixed")
# What a run saved before a field existed did, where that is not the field's default today.
BEFORE_THE_FIELD = {
    "slot_weights": "exp",
    "batching": "bucketed",
    "anchor_rule": "pair",
    "loss_norm": "weights",
    "noise": "gaussian",
    "optimizer": "adamw",
    "schedule": "cosine",
}


class MetricsLog:
    """OUT/metrics.jsonl plus Accelerate trackers; written by the main process only."""

    def __init__(self, accelerator, out: Path, start_step: int, total_steps: int) -> None:
        self.acc, self.path = accelerator, out / "metrics.jsonl"
        if self.acc.is_main_process:
            out.mkdir(parents=True, exist_ok=True)
            if self.path.exists():  # on resume, drop the records the run redoes
                records = [x for x in self.path.read_text().splitlines() if x]
                keep = [x for x in records if kept(json.loads(x), start_step, total_steps)]
                self.path.write_text("".join(x + "\n" for x in keep))

    def write(self, record: dict) -> None:
        if self.acc.is_main_process:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
            self.acc.log(
                {f"{record['split']}/{k}": v for k, v in record.items() if isinstance(v, (int, float))},
                step=record["step"],
            )


def claim(out: Path) -> LockFile | None:
    """OUT for this launch's main process (None on the others): refused while another live run holds
    it, and when it is another command's output (a store, a report, a drafter checkpoint). A killed
    run's lock is taken over (its pid is gone, or its lease ran out)."""
    if devices.Process.from_env().rank != 0:
        return None
    lock = out_dir.claim(out / RUN_LOCK, "--out", out, "training run")
    try:
        refuse_other_kinds(
            out, RUN, "--out", "train.py writes a run into an empty directory or its own run", mine=(RUN_LOCK,)
        )
    except BaseException:
        lock.release()
        raise
    return lock


def kept(record: dict, start: int, total: int) -> bool:
    """Whether a metrics record survives a resume from step `start`: those up to the checkpoint,
    except the final validation (written after the last checkpoint, redone by the finish) and
    everything of a run that had no checkpoint yet (start 0: it starts over)."""
    if record["step"] == start == total:
        return record["split"] == "train"
    return 0 < start and record["step"] <= start


def training_record(setup, config: TrainConfig, step: int) -> TrainingRecord:
    return TrainingRecord(
        store_fingerprint=setup.store_fingerprint,
        store_conditioning=setup.store_conditioning,
        store_placement=setup.store_placement,
        store=config.data.store,
        store_taps=setup.store_taps,
        train_shards=setup.train_shards_text,
        eval_shards=setup.eval_shards_text,
        step=step,
        epochs=epochs_at(setup, config, step),
        train_config=config.record(),
    )


def epochs_at(setup, config: TrainConfig, step: int) -> float:
    """Epochs made after `step` optimizer steps: counted in epoch 0's batches (epochs_done), or, when
    epochs differ in size (--follow, --shard-schedule), walked epoch by epoch (epochs_walked)."""
    if setup.schedule.mode == "fixed":
        return epochs_done(step, config.optim.grad_accum, setup.micro_per_epoch)
    return epochs_walked(
        config.data,
        setup.schedule.refs,
        setup.position,
        (step - setup.start_step) * config.optim.grad_accum,
        setup.accelerator.num_processes,
        setup.local_processes,
    )


def write_drafter(setup, config: TrainConfig, directory: Path, step: int, atomic: bool = True) -> None:
    """The drafter in the released layout (bf16), written by the main process: atomically into
    DIRECTORY, or into an existing directory the caller publishes itself."""
    state = setup.accelerator.get_state_dict(setup.model)
    if setup.accelerator.is_main_process:
        if atomic:  # what a killed run left of an earlier write of DIRECTORY (this run holds OUT's lock)
            for stale in [
                *directory.parent.glob(f".{directory.name}.tmp*"),
                *directory.parent.glob(f".{directory.name}.old*"),
            ]:
                shutil.rmtree(stale, ignore_errors=True)
        record = training_record(setup, config, step)
        if atomic:  # checkpoint.save leaves no temporary directory when it fails
            with not_saved_when_full(directory, None, step):
                checkpoint.save(directory, setup.drafter_config, state, record)
        else:
            checkpoint.write(directory, setup.drafter_config, state, record)
    setup.accelerator.wait_for_everyone()


def save_step(setup, config: TrainConfig, step: int) -> None:
    """OUT/step-N: drafter checkpoint + OUT/step-N/training (model, optimizers, schedules, RNG; each
    rank writes its share), built in a temporary directory and published by a rename."""
    acc = setup.accelerator
    final = Path(config.run.out) / f"step-{step}"
    tmp = final.with_name(f".step-{step}.tmp")
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    with not_saved_when_full(tmp, tmp if acc.is_main_process else None, step):
        if acc.is_main_process:
            (tmp / "training").mkdir(parents=True)
        acc.wait_for_everyone()
        trainer_state.save(tmp / "training", acc, setup.raw, setup.optimizers, setup.schedulers)
        write_drafter(setup, config, tmp, step, atomic=False)
        _finish_step(setup, config, step, tmp, final)
    acc.wait_for_everyone()


MOMENTUM = "muon-momentum-rank-{}.pt"  # Accelerate's layout: one rank's share of Muon's momentum {matrix index: buffer}
ACCELERATE_MODEL = ("model.safetensors", "pytorch_model.bin")  # Accelerate's save_state wrote one of these


def load_training(directory: Path, acc, raw, optimizers: list, schedulers: list) -> None:
    """--resume: OUT/step-N/training into the model, optimizers, schedules and RNG, on every rank.
    Either layout: the trainer state (trainer_state.py), or Accelerate's save_state with Muon's
    momentum shards (what runs wrote before)."""
    if trainer_state.is_saved_here(directory):
        trainer_state.load(directory, acc, raw, optimizers, schedulers)
    elif any((directory / name).exists() for name in ACCELERATE_MODEL):
        acc.load_state(str(directory))
        load_momentum(optimizers, directory)
    else:
        raise ConfigError(
            "--resume",
            directory,
            f"holds no trainer state (neither {trainer_state.METADATA} nor {ACCELERATE_MODEL[0]}); resume from "
            "another step-N, or start the run over in another --out",
        )


def load_momentum(optimizers: list, directory: Path) -> None:
    """Accelerate's layout: every rank's saved share read (memory-mapped), this rank's matrices kept:
    any number of processes saved them and reads them. A checkpoint without shards (one process, or
    saved before they existed: every rank then held all the momentum) has it all in the optimizer file."""
    for muon in muons(optimizers):
        for shard in sorted(directory.glob(MOMENTUM.format("*"))):
            muon.take_momentum(torch.load(shard, map_location="cpu", mmap=True, weights_only=True))


def muons(optimizers: list) -> list[Muon]:
    """The Muon optimizers among a run's (Accelerate wraps each)."""
    return [o for o in (getattr(o, "optimizer", o) for o in optimizers) if isinstance(o, Muon)]


@contextlib.contextmanager
def not_saved_when_full(where: Path, remove: Path | None, step: int):
    """A checkpoint being written into `where`: when the write fails, `remove` (the temporary
    directory, for the process that owns it) is deleted, and a full disk, quota or file-size limit
    becomes one line naming `where` and what to do (the writers' own errors lose the path: safetensors
    says `os error 28`, torch's zip writer 'unexpected pos')."""
    try:
        yield
    except Exception as e:
        full = full_disk(e, where.parent)
        if remove is not None:
            shutil.rmtree(remove, ignore_errors=True)
        if full is None:
            raise
        raise TrainingError(
            f"{where}: {os.strerror(full.errno).lower()} while saving the checkpoint of step {step}; "
            f"nothing of it is kept; {FULL_FIX[full.errno].format(where.parent)}, then rerun the "
            "same command with --resume (it continues from the newest step-N there)"
        ) from e


FULL_FIX = {
    errno.ENOSPC: "free space on {}'s file system",
    errno.EDQUOT: "free space within your quota on {}'s file system",
    errno.EFBIG: "raise the file-size limit (`ulimit -f`)",
}


def _finish_step(setup, config: TrainConfig, step: int, tmp: Path, final: Path) -> None:
    """The main process: step-N's trainer state written, the directory published, old steps pruned."""
    acc = setup.accelerator
    if acc.is_main_process:
        file_modes.tree_as_umask(tmp / "training")  # every rank's files as the umask makes them
        at = advance(
            config.data,
            setup.schedule.refs,
            setup.position,
            (step - setup.start_step) * config.optim.grad_accum,
            acc.num_processes,
            setup.local_processes,
        )
        epochs = setup.schedule.to_json()  # --follow, --shard-schedule: each epoch's shards so far
        at = dataclasses.replace(at, schedule=None if epochs is None else tuple(epochs))
        state = {
            "step": step,
            "total_steps": setup.total_steps,
            "world_size": acc.num_processes,
            "micro_per_epoch": setup.micro_per_epoch,
            "position": at.to_json(),
            "train_config": config.record(),
            "store_fingerprint": setup.store_fingerprint,
        }
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1) + "\n")
        checkpoint.publish(tmp, final)
        prune_steps(Path(config.run.out), step, config.run.keep_last)


STEP_DIR = re.compile(r"step-(\d+)")  # a published checkpoint
STEP_TMP = re.compile(r"\.step-(\d+)\.tmp")  # one being built (save_step) or deleted (prune_steps)


def complete_steps(out: Path) -> list[tuple[int, Path]]:
    """OUT's published step-N checkpoints (with trainer_state.json), oldest first."""
    found = [(int(m.group(1)), p) for p in out.glob("step-*") if (m := STEP_DIR.fullmatch(p.name))]
    return sorted((n, p) for n, p in found if (p / "trainer_state.json").exists())


def prune_steps(out: Path, newest: int, keep: int) -> list[Path]:
    """After OUT/step-NEWEST is published: delete the published step-M with M < NEWEST beyond the
    newest KEEP (step-NEWEST counting as one), and the hidden .step-M.tmp (M < NEWEST) of a save that
    crashed. Never touched: step-NEWEST, any step-M with M > NEWEST (left by a run that went further
    before this one resumed from an earlier step; saves replace them in turn), final/, step
    directories without trainer_state.json, and anything else. A resumed run's source step-R has
    R < NEWEST, so it goes only once a newer checkpoint is complete. keep 0: delete nothing.
    Main process only, between saves: no .step-M.tmp of this run is being written. Returns the
    deleted step directories."""
    if keep == 0:
        return []
    older = [p for n, p in complete_steps(out) if n < newest]
    doomed = older[: max(0, len(older) - (keep - 1))]
    for p in doomed:  # hidden first, so a crash mid-delete leaves no step-M that looks complete
        hidden = p.with_name(f".{p.name}.tmp")
        shutil.rmtree(hidden, ignore_errors=True)
        os.replace(p, hidden)
    for p in out.glob(".step-*.tmp"):
        m = STEP_TMP.fullmatch(p.name)
        if m and int(m.group(1)) < newest:
            shutil.rmtree(p)
    return doomed


def write_audit(setup, out: Path, seen: list[list[int]]) -> None:
    """OUT/audit/rank-N.json: what this rank read and a hash of its parameters (checks a DDP run)."""
    digest = hashlib.sha256()
    for name, p in sorted(setup.raw.named_parameters()):
        digest.update(name.encode())
        digest.update(p.detach().float().cpu().numpy().tobytes())
    d = out / "audit"
    d.mkdir(parents=True, exist_ok=True)
    rec = {
        "rank": setup.accelerator.process_index,
        "world_size": setup.accelerator.num_processes,
        "samples": seen,
        "param_sha256": digest.hexdigest(),
    }
    (d / f"rank-{setup.accelerator.process_index}.json").write_text(json.dumps(rec) + "\n")


def latest_step(out: Path) -> Path | None:
    steps = complete_steps(out)
    return steps[-1][1] if steps else None


def resume_dir(config: RunConfig) -> Path | None:
    """The checkpoint --resume continues from; None for a fresh run, and for `--resume` (latest) when
    OUT holds no complete step-N yet (a run killed before its first save starts over)."""
    if not config.resume:
        return None
    if config.resume == "latest":
        return latest_step(Path(config.out))
    d = Path(config.resume)
    if not (d / "trainer_state.json").exists():
        raise ConfigError("--resume", d, "not a training checkpoint (no trainer_state.json)")
    return d


def resume_point(config: TrainConfig, fingerprint: str) -> tuple[Path | None, dict | None]:
    """(step directory, its trainer_state) for --resume, after checking the run may continue from
    it; (None, None) for a fresh run, which refuses an OUT that already holds one."""
    rdir = resume_dir(config.run)
    if rdir is None and config.run.resume:
        return None, None  # nothing complete to continue: from step 0 (metrics.jsonl is started over)
    if rdir is None:
        used = sorted(
            p.name
            for p in Path(config.run.out).glob("*")
            if p.name in ("metrics.jsonl", "final") or p.name.startswith("step-")
        )
        if used:
            raise ConfigError(
                "--out",
                config.run.out,
                f"already holds a run ({', '.join(used[:3])}); pass --resume to continue it, or choose another --out",
            )
        return None, None
    previous = json.loads((rdir / "trainer_state.json").read_text())
    resumable(config, previous["train_config"])
    if previous["store_fingerprint"] != fingerprint:
        raise ConfigError(
            "--resume",
            rdir,
            f"trained on store {previous['store_fingerprint'][:12]}, {config.data.store} is {fingerprint[:12]}",
        )
    return rdir, previous


def resumable(config: TrainConfig, previous: dict) -> None:
    """previous: the run's record (TrainConfig.record). A field a run saved before it existed had its
    behaviour then: BEFORE_THE_FIELD, else its default."""
    defaults = {name: f.default for name, f in leaves(TrainConfig).items()} | BEFORE_THE_FIELD
    now = config.record()
    diff = [
        f"{flag_of(config, k)} was {previous.get(k, defaults[k])!r}, now {now[k]!r}"
        for k in RESUME_FIXED
        if previous.get(k, defaults[k]) != now[k]
    ]
    if diff:
        raise ConfigError("--resume", None, "the run's settings changed (" + "; ".join(diff) + ")")
