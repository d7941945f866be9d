"""Re-read every committed shard and check shapes, offsets, masks and checksums."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from store import layout
from store.hidden_store import HiddenStore
from store.ranges import format_ranges, parse_ranges
from store.schema import ShardCommit


@dataclass
class Report:
    checked: list[int] = field(default_factory=list)
    problems: dict[int, list[str]] = field(default_factory=dict)  # shard -> what is wrong
    missing: list[int] = field(default_factory=list)  # expected but not committed
    partial: list[int] = field(default_factory=list)  # data without a commit file (redone on rerun)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.missing

    def lines(self) -> list[str]:
        """What is wrong (CORRUPT, MISSING) and what a rerun redoes, one line each."""
        out = [f"CORRUPT {'root' if shard < 0 else f'shard {shard}'}: {p}"
               for shard, problems in sorted(self.problems.items()) for p in problems]
        if self.missing:
            out.append(f"MISSING shards {format_ranges(self.missing)}: not committed")
        if self.partial:
            out.append(f"note: shards {format_ranges(self.partial)} hold uncommitted data (a rerun redoes them)")
        return out

    def verdict(self) -> str:
        return f"checked {len(self.checked)} committed shard(s): " + (
            "all good" if self.ok else f"{len(self.problems)} corrupt, {len(self.missing)} missing")


def verify_store(location: str, shard_text: str | None = None, progress=None) -> Report:
    """`pipeline verify`: check the store at location; shard_text (e.g. '0-63') names the shards
    that must be committed."""
    store = HiddenStore(location)
    expected = parse_ranges(shard_text, store.num_shards) if shard_text else None
    return verify(store, expected, progress)


def verify(store: HiddenStore, expected: list[int] | None = None, progress=None) -> Report:
    """Check committed shards and the root; `expected` shards that are not committed count as missing.

    progress: called with each shard id once it is checked.
    """
    n_taps, hidden_size = len(store.attrs.taps), store.attrs.hidden_size
    committed = store.committed()
    report = Report()
    for shard, record in committed.items():
        problems = check_shard(store, shard, record, n_taps, hidden_size)
        report.checked.append(shard)
        if problems:
            report.problems[shard] = problems
        if progress is not None:
            progress(shard)
    report.missing = [s for s in (expected or []) if s not in committed]
    report.partial = [s for s in range(store.num_shards) if s not in committed and store.has_data(s)]
    if root_problems := check_root(store):
        report.problems[-1] = root_problems
    return report


def check_root(store: HiddenStore) -> list[str]:
    """The frozen embedding and lm_head: shapes and checksums against the root commit file."""
    attrs, sums = store.attrs, (store.read_json(layout.commit_key("root")) or {}).get("checksums", {})
    problems = []
    for name in ("embed_tokens", "lm_head"):
        try:
            w = store.group("r")[f"target/{name}"]
            if w.shape != (attrs.vocab_size, attrs.hidden_size):
                problems.append(f"target/{name}: shape {w.shape}")
            elif layout.crc32(w[:]) != sums.get(name):
                problems.append(f"target/{name}: checksum mismatch")
        except Exception as e:  # noqa: BLE001 - name what broke
            problems.append(f"target/{name}: unreadable ({type(e).__name__}: {e})")
    return problems


def check_shard(store: HiddenStore, shard: int, record: ShardCommit, n_taps: int, hidden_size: int) -> list[str]:
    problems: list[str] = []
    try:
        g = store.shard_arrays(shard)
        arrays = {name: g[name] for name in layout.SHARD_ARRAYS}
    except Exception as e:  # noqa: BLE001
        return [f"arrays missing or unreadable ({type(e).__name__}: {e})"]
    shapes = record.shapes
    for name, arr in arrays.items():
        if list(arr.shape) != shapes.get(name):
            problems.append(f"{name}: shape {list(arr.shape)}, commit file says {shapes.get(name)}")
        if arr.dtype != layout.ARRAY_DTYPES[name]:
            problems.append(f"{name}: dtype {arr.dtype}, expected {np.dtype(layout.ARRAY_DTYPES[name])}")
    if problems:
        return problems
    if tuple(arrays["hidden"].shape[1:]) != (n_taps, hidden_size):
        problems.append(f"hidden: shape {arrays['hidden'].shape}, expected [T, {n_taps}, {hidden_size}]")
    sums = record.checksums
    try:
        small = {name: arrays[name][:] for name in layout.SHARD_ARRAYS if name != "hidden"}
    except Exception as e:  # noqa: BLE001
        return problems + [f"small arrays unreadable ({type(e).__name__}: {e})"]
    for name, data in small.items():
        if layout.crc32(data) != sums.get(name):
            problems.append(f"{name}: checksum mismatch")
    problems += _check_offsets(small, int(arrays["hidden"].shape[0]), store.attrs.compat.turns == "all")
    try:
        if _hidden_crc(arrays["hidden"]) != sums.get("hidden"):
            problems.append("hidden: checksum mismatch (a chunk file is corrupt, missing or replaced)")
    except Exception as e:  # noqa: BLE001 - a chunk that cannot be decoded
        problems.append(f"hidden: unreadable chunk ({type(e).__name__}: {e})")
    return problems


def _check_offsets(small: dict, total: int, every_turn: bool) -> list[str]:
    """every_turn: the loss may also lie on earlier assistant turns inside the prompt (--turns all)."""
    off, plen = small["offsets"], small["prompt_lens"]
    problems = []
    if len(off) != len(plen) + 1 or len(small["row_ids"]) != len(plen):
        return [f"offsets/prompt_lens/row_ids lengths disagree: {len(off)}, {len(plen)}, {len(small['row_ids'])}"]
    if off[0] != 0 or off[-1] != total or len(small["tokens"]) != total or np.any(np.diff(off) <= 0):
        problems.append(f"offsets do not tile the {total} tokens in increasing order")
        return problems
    lengths = np.diff(off)
    if np.any(plen <= 0) or np.any(plen >= lengths):
        problems.append("a prompt length is not inside its sample")
        return problems
    mask = small["loss_mask"]
    if np.any(mask > 1):
        return problems + ["loss_mask holds values other than 0 and 1"]
    expected = np.ones(total, dtype=np.uint8)
    for a, p in zip(off[:-1], plen):
        expected[a:a + p] = mask[a:a + p] if every_turn else 0
    if not np.array_equal(expected, mask):
        problems.append("loss_mask is not exactly the completion tokens" + (" (and earlier answers)" if every_turn else ""))
    return problems


def _hidden_crc(arr) -> int:
    crc = 0
    step = arr.shards[0] if getattr(arr, "shards", None) else arr.chunks[0]
    for a in range(0, arr.shape[0], step):
        crc = layout.crc32(arr[a:a + step], crc)
    return crc
