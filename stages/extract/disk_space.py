"""Disk space for an extraction: the bytes the shards still to write need, checked against the free
space of a local store before anything is written, and the one line a full disk ends a run with.

The estimate (`Need`, made by `needed`) is upper-ish, by design:

- **From the store itself** when it has committed shards that recorded their size (the commit
  files' `bytes`, docs/store.md): their bytes on disk per dataset row (skipped rows included),
  times the rows of each shard to write, plus `HEADROOM`. Every shard of a store was made with the
  same limits, taps and codec (they are in its `compat`), so this measured figure already holds
  the completion limit, the width and the compression; the headroom covers shards whose rows run
  longer than the average.
- **From the settings** otherwise (a new store, or one with nothing committed yet): per row, the
  prompt plus a completion at its full limit (`--max-new-tokens`, within `--max-length`), the mean
  over a sample of the rows to write (`tokens_per_row` over `SAMPLED_ROWS` rows, `spread` evenly);
  per token, `n_taps x H x 2` bytes of bf16 states (`(n_taps + 1) x H x 2` with --final-state) times a
  conservative stored fraction (its hidden format's `stored_fraction`, store/format/hidden_formats.py),
  plus the token ids and the loss mask; a new store adds its embedding and lm_head. Completions that
  end early and better compression only make the real size smaller.

Object stores (any fsspec URL that is not a local path) are not checked: the line says so.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from math import ceil
from pathlib import Path

from pipeline import chat_template
from pipeline import prompts as prompt_sets
from pipeline.target.model import Target
from stages.extract.config import ExtractConfig
from stages.paths import full_disk
from store.errors import StoreError
from store.format import hidden_formats
from store.format.hidden_formats import HiddenFormat
from store.format.schema import ShardCommit, StoreAttrs, completion_limit
from store.hidden_store import HiddenStore
from store.summary import human_bytes

# Stored bytes over raw bytes of the embedding and lm_head, planes coded as bf16 states are; a store's
# states take their hidden format's `stored_fraction` (store/format/hidden_formats.py).
STORED_FRACTION = hidden_formats.BF16.stored_fraction
SMALL_BYTES_PER_TOKEN = 5  # tokens (int32) and loss_mask (uint8), stored as they are at worst
SMALL_BYTES_PER_ROW = 32  # offsets, prompt_lens, row_ids, first_pairs
HEADROOM = 1.2  # on the bytes per row measured from committed shards
SAMPLED_ROWS = 64  # rows whose prompts are rendered to estimate a new store's size
# no space left; disk quota exceeded; a file past the file-size limit (`ulimit -f`, or the file system's) -> the way on
FULL = {
    errno.ENOSPC: "free space",
    errno.EDQUOT: "free space within the quota",
    errno.EFBIG: "raise the file-size limit (`ulimit -f`)",
}


@dataclass(frozen=True)
class Need:
    """Bytes estimated for each shard to write, and for the root when this run creates the store."""

    shards: dict[int, int]  # shard -> bytes
    root: int
    basis: str  # how it was estimated, for the log line

    @property
    def total(self) -> int:
        return self.root + sum(self.shards.values())

    def left(self, committed) -> int:
        """Bytes still needed once the shards in `committed` are done."""
        return sum(n for s, n in self.shards.items() if s not in committed)


def needed(
    config: ExtractConfig,
    store: HiddenStore,
    target: Target,
    attrs: StoreAttrs,
    prompt_set: prompt_sets.PromptSet,
    rows: dict[int, range],
    done: dict[int, ShardCommit],
) -> Need:
    """The bytes the shards of `rows` (shard -> its dataset rows) will take: measured from the store's
    committed shards when it has some, else from the settings (the module docstring)."""
    counts = {s: len(r) for s, r in rows.items()}
    need = from_commits(done, counts)
    if need is not None:
        return need
    root = 0 if store.exists() else 2 * attrs.vocab_size * attrs.hidden_size * 2  # embed_tokens + lm_head, bf16
    per_row = tokens_per_row(config, target, prompt_set, spread(list(rows.values()), SAMPLED_ROWS))
    return from_limits(
        counts, per_row, len(attrs.taps), attrs.hidden_size, root, attrs.compat.format, bool(attrs.compat.final_state)
    )


def from_commits(committed: dict[int, ShardCommit], rows: dict[int, int]) -> Need | None:
    """rows: shard to write -> its dataset rows. None when no committed shard recorded its bytes."""
    measured = [r for r in committed.values() if r.bytes]
    seen = sum(r.samples + sum(r.skipped.values()) for r in measured)
    if not seen:
        return None
    per_row = sum(r.bytes["shard"] for r in measured) / seen
    return Need(
        {s: ceil(per_row * n * HEADROOM) for s, n in rows.items()},
        0,
        f"{human_bytes(round(per_row))} per row measured over {len(measured)} committed shard(s), +{HEADROOM - 1:.0%}",
    )


def from_limits(
    rows: dict[int, int],
    tokens_per_row: float,
    n_taps: int,
    hidden_size: int,
    root_raw: int,
    hidden_format: HiddenFormat = hidden_formats.BF16,
    final_state: bool = False,
) -> Need:
    """rows: shard to write -> its dataset rows; tokens_per_row: prompt + completion at its limit, a
    mean; root_raw: raw bytes of the embedding and lm_head of a store this run creates (else 0);
    final_state: a final state per token too (--final-state), one more state of H values."""
    frac = hidden_format.stored_fraction
    per_token = (n_taps + final_state) * hidden_size * 2 * frac + SMALL_BYTES_PER_TOKEN
    per_row = tokens_per_row * per_token + SMALL_BYTES_PER_ROW
    return Need(
        {s: ceil(per_row * n) for s, n in rows.items()},
        ceil(root_raw * STORED_FRACTION),
        f"{tokens_per_row:.0f} tokens per row at the length limits x {n_taps} taps"
        f"{' + the final state' if final_state else ''} x {hidden_size} x 2 bytes, "
        f"stored at {frac:.2f} of raw bf16",
    )


def tokens_per_row(config: ExtractConfig, target: Target, prompt_set: prompt_sets.PromptSet, rows: list[int]) -> float:
    """Prompt + completion at its limit (the completion length rule), the mean over rows; a row
    extraction would skip (empty, too long) counts 0."""
    total = 0
    for i in rows:
        row = prompt_set.row(i)
        if not prompt_sets.has_prompt(row):
            continue
        n = (
            len(row.prompt_ids)
            if row.prompt_ids is not None
            else len(
                chat_template.for_row(target.tokenizer, row, config.template_args(), prompt_set.source).ids(
                    row.messages, generation_prompt=True
                )
            )
        )
        if n < config.max_length:
            total += n + completion_limit(config.max_new_tokens, config.max_length, n)
    return total / len(rows) if rows else 0.0


def spread(ranges: list[range], k: int) -> list[int]:
    """Up to k rows evenly spread over the rows of `ranges`, taken in order."""
    total = sum(map(len, ranges))
    n = min(k, total)
    picks = iter(sorted({j * total // n for j in range(n)}))
    out, base, p = [], 0, next(picks, None)
    for r in ranges:
        while p is not None and p < base + len(r):
            out.append(r[p - base])
            p = next(picks, None)
        base += len(r)
    return out


def free_at(path: str) -> tuple[str, int]:
    """(the nearest existing folder at or above path, its file system's free bytes)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return str(p), shutil.disk_usage(p).free


def check(store: HiddenStore, need: Need, ignore: bool, say) -> None:
    """One line: the bytes needed against those free where the store lives. Refuses to start when
    fewer are free than the estimate, unless `ignore` (--ignore-free-space)."""
    if not need.shards:
        return
    what = f"{len(need.shards)} shard(s) to write need about {human_bytes(need.total)} ({need.basis})"
    if not store.local:
        say(f"space: {what}; {store.location} is not a local path, free space not checked")
        return
    where, free = free_at(store.root)
    short = free < need.total
    say(
        f"space: {what}; {human_bytes(free)} free at {where}"
        + ("; less than the estimate, going on (--ignore-free-space)" if short and ignore else "")
    )
    if short and not ignore:
        raise StoreError(
            f"{store.location}: not enough free space: {len(need.shards)} shard(s) to write need about "
            f"{human_bytes(need.total)} and {human_bytes(free)} is free at {where}; free space or choose "
            "another --store, or pass --ignore-free-space to start anyway"
        )


@contextmanager
def stop_when_full(store: HiddenStore, need: Need) -> Iterator[None]:
    """A full disk, quota or file-size limit anywhere inside (writer thread, zarr, commit file)
    becomes one line naming the store, the space still needed and the way on. Nothing half-written
    is committed: a shard's commit file is written last, so the shard in progress stays uncommitted
    and a rerun deletes and redoes it."""
    try:
        yield
    except Exception as e:
        err = full_disk(e)
        if err is None:
            raise
        left = need.left(store.committed())
        raise StoreError(
            f"{store.location}: {os.strerror(err.errno).lower()}; the shards still to write need "
            f"about {human_bytes(left)}: committed shards are kept, the shard in progress is left "
            f"uncommitted; {FULL[err.errno]} and rerun the same command to complete the store"
        ) from e
