"""Re-read committed shards and check shapes, offsets, masks and checksums: all of them or chosen
ones, every byte or a random sample of the state chunks, in one process or several."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from store import span_reader
from store.errors import StoreCorrupt
from store.format import layout
from store.format.ranges import format_ranges, parse_ranges
from store.format.schema import ShardCommit
from store.hidden_store import HiddenStore


@dataclass
class Report:
    checked: list[int] = field(default_factory=list)
    problems: dict[int, list[str]] = field(default_factory=dict)  # shard -> what is wrong
    missing: list[int] = field(default_factory=list)  # expected but not committed
    partial: list[int] = field(default_factory=list)  # data without a commit file (redone on rerun)
    chunks: list[int] = field(default_factory=lambda: [0, 0])  # state chunks decoded, of how many
    whole: bool = False  # a sample was asked for, but the layout has no chunk checksums: every byte was checked

    @property
    def ok(self) -> bool:
        return not self.problems and not self.missing

    def lines(self) -> list[str]:
        """What is wrong (CORRUPT, MISSING) and what a rerun redoes, one line each."""
        out = [
            f"CORRUPT {'root' if shard < 0 else f'shard {shard}'}: {p}"
            for shard, problems in sorted(self.problems.items())
            for p in problems
        ]
        if self.missing:
            out.append(f"MISSING shards {format_ranges(self.missing)}: not committed")
        if self.partial:
            out.append(f"note: shards {format_ranges(self.partial)} hold uncommitted data (a rerun redoes them)")
        return out

    def verdict(self) -> str:
        decoded, total = self.chunks
        coverage = "" if decoded == total else f" (states: {decoded} of {total} chunks decoded, {decoded / total:.1%})"
        if self.whole:
            coverage = " (every byte: this layout has no chunk checksums to sample)"
        return f"checked {len(self.checked)} committed shard(s){coverage}: " + (
            "all good" if self.ok else f"{len(self.problems)} corrupt, {len(self.missing)} missing"
        )


def verify_store(
    location: str, shard_text: str | None = None, progress=None, sample: float | None = None, processes: int = 1
) -> Report:
    """`pipeline verify`: check the store at location; shard_text (e.g. '0-63') limits the check
    to those shards, each of which must be committed."""
    store = HiddenStore(location)
    expected = parse_ranges(shard_text, store.num_shards) if shard_text else None
    return verify(store, expected, progress, sample, processes)


def verify(
    store: HiddenStore,
    expected: list[int] | None = None,
    progress=None,
    sample: float | None = None,
    processes: int = 1,
) -> Report:
    """Check the root and the `expected` shards (default: every committed one); expected shards
    that are not committed count as missing. sample: the share of state chunks to decode, chosen
    at random (None: every byte, and each whole array against its commit checksum); processes:
    shards checked in parallel. progress: called with each shard id once it is checked. A layout
    without chunk checksums (store/format/read_checks.py) is checked whole whatever `sample` says: a
    sampled chunk of it that decodes proves nothing."""
    committed, damaged = store.commits()
    todo = [s for s in (expected if expected is not None else committed) if s in committed]
    report = Report()
    if sample is not None and not store.read_checks({s: committed[s] for s in todo}).chunk_checksums:
        report.whole, sample = True, None
    jobs = [(store.location, s, committed[s], sample) for s in todo]
    for shard, (problems, chunks) in zip(todo, _results(jobs, store, processes)):
        report.checked.append(shard)
        report.chunks = [report.chunks[0] + chunks[0], report.chunks[1] + chunks[1]]
        if problems:
            report.problems[shard] = problems
        if progress is not None:
            progress(shard)
    for shard, error in damaged.items():
        if expected is None or shard in expected:
            report.problems[shard] = [error.damage]
    report.missing = [s for s in (expected or []) if s not in committed and s not in damaged]
    report.partial = [
        s for s in range(store.num_shards) if s not in committed and s not in damaged and store.has_data(s)
    ]
    if root_problems := check_root(store):
        report.problems[-1] = root_problems
    return report


def _results(jobs: list[tuple], store: HiddenStore, processes: int):
    """Each job's `_check`, in order, here or in `processes` worker processes."""
    if processes <= 1 or not jobs:
        yield from (_check(*job, store) for job in jobs)
        return
    with ProcessPoolExecutor(min(processes, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as pool:
        yield from pool.map(_check, *zip(*jobs))


def _check(location: str, shard: int, record: ShardCommit, sample: float | None, store: HiddenStore | None = None):
    """One shard's problems and (chunks decoded, chunks in all); runs in a worker process too (which
    opens the store itself)."""
    store = store or HiddenStore(location)
    return check_shard(store, shard, record, len(store.attrs.taps), store.attrs.hidden_size, sample)


def check_root(store: HiddenStore) -> list[str]:
    """The frozen embedding and lm_head: shapes and checksums against the root commit file."""
    attrs = store.attrs
    problems = []
    for name in ("embed_tokens", "lm_head"):
        try:
            w = store.embedding(name)  # checked against the root commit's checksum
            if tuple(w.shape) != (attrs.vocab_size, attrs.hidden_size):
                problems.append(f"target/{name}: shape {tuple(w.shape)}")
        except StoreCorrupt as e:
            problems.append(e.damage)
    return problems


def check_shard(
    store: HiddenStore, shard: int, record: ShardCommit, n_taps: int, hidden_size: int, sample: float | None = None
) -> tuple[list[str], tuple[int, int]]:
    """A shard's problems, and (state chunks decoded, state chunks in all)."""
    try:
        store.check_shard_files(shard, record)
    except StoreCorrupt as e:
        return [e.damage], (0, 0)
    try:
        g = store.shard_arrays(shard)
        optional = (*layout.INDEX_ARRAYS, layout.FINAL_STATE)
        names = layout.SHARD_ARRAYS + tuple(n for n in optional if n in record.shapes)
        arrays = {name: g[name] for name in names}
    except Exception as e:  # noqa: BLE001
        return [f"arrays missing or unreadable ({type(e).__name__}: {e})"], (0, 0)
    if store.layout.final_state and layout.FINAL_STATE not in arrays:
        return [
            f"{layout.FINAL_STATE}: not in the shard's commit file, though the store keeps a final state per "
            "token (written by a version without --final-state)"
        ], (0, 0)
    problems = [
        f"{name}: shape {list(arr.shape)}, commit file says {record.shapes.get(name)}"
        for name, arr in arrays.items()
        if list(arr.shape) != record.shapes.get(name)
    ]
    problems += [
        f"{name}: dtype {arr.dtype}, expected {np.dtype(layout.ARRAY_DTYPES[name])}"
        for name, arr in arrays.items()
        if arr.dtype != layout.ARRAY_DTYPES[name]
    ]
    if problems:
        return problems, (0, 0)
    if tuple(arrays["hidden"].shape[1:]) != (n_taps, hidden_size):
        problems.append(f"hidden: shape {arrays['hidden'].shape}, expected [T, {n_taps}, {hidden_size}]")
    final = arrays.get(layout.FINAL_STATE)
    if final is not None and tuple(final.shape) != (arrays["hidden"].shape[0], hidden_size):
        problems.append(
            f"{layout.FINAL_STATE}: shape {final.shape}, expected [{arrays['hidden'].shape[0]}, {hidden_size}]"
        )
    try:
        small = {name: arr[:] for name, arr in arrays.items() if name not in layout.STATE_ARRAYS}
    except Exception as e:  # noqa: BLE001
        return problems + [f"small arrays unreadable ({type(e).__name__}: {e})"], (0, 0)
    problems += [
        f"{name}: checksum mismatch" for name, data in small.items() if layout.crc32(data) != record.checksums.get(name)
    ]
    problems += _check_offsets(small, int(arrays["hidden"].shape[0]), store.attrs.compat.turns == "all")
    if (
        "first_pairs" in small
        and not problems
        and not np.array_equal(small["first_pairs"], layout.first_pairs(small["loss_mask"], small["offsets"]))
    ):
        problems.append("first_pairs does not match the loss mask")
    checked = [0, 0]
    for name in (n for n in layout.STATE_ARRAYS if n in arrays):
        spans = None
        if sample is not None:  # chunk checksums: read straight from the chunk files, a missing one damage
            checks = store.read_checks({shard: record})
            spans = (
                span_reader.for_array(
                    store.fs, store.path(f"{layout.shard_group(shard)}/{name}"), arrays[name], checks.every_chunk(shard)
                )
                if checks.direct_reads
                else None
            )
        found, chunks = _check_states(name, arrays[name], record.checksums.get(name), sample, shard, spans)
        problems += found
        checked = [checked[0] + chunks[0], checked[1] + chunks[1]]
    return problems, tuple(checked)


def _check_states(
    name: str, arr, checksum: int | None, sample: float | None, seed: int, spans=None
) -> tuple[list[str], tuple[int, int]]:
    """A state array (`hidden`, `final_state`): every chunk decoded and the whole array's CRC-32 compared, or
    (sample) a random share of the chunks decoded, each against its own crc32c; spans: the direct reader of
    arr (else zarr reads)."""
    step = arr.chunks[0]
    total = -(-int(arr.shape[0]) // step)
    if sample is None:
        try:
            if _hidden_crc(arr) != checksum:
                return [f"{name}: checksum mismatch (a chunk file is corrupt, missing or replaced)"], (total, total)
        except Exception as e:  # noqa: BLE001 - a chunk that cannot be decoded
            return [f"{name}: unreadable chunk ({type(e).__name__}: {e})"], (total, total)
        return [], (total, total)
    picks = sorted(np.random.default_rng(seed).permutation(total)[: max(1, round(sample * total))]) if total else []
    for k in picks:
        try:
            if spans is not None:
                spans.read(k * step, min((k + 1) * step, int(arr.shape[0])))
            else:
                arr[k * step : (k + 1) * step]
        except Exception as e:  # noqa: BLE001
            return [
                f"{name}: chunk {k} (tokens {k * step}-{(k + 1) * step - 1}) unreadable ({type(e).__name__}: {e})"
            ], (len(picks), total)
    return [], (len(picks), total)


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
        expected[a : a + p] = mask[a : a + p] if every_turn else 0
    if not np.array_equal(expected, mask):
        problems.append(
            "loss_mask is not exactly the completion tokens" + (" (and earlier answers)" if every_turn else "")
        )
    return problems


def _hidden_crc(arr) -> int:
    crc = 0
    step = arr.shards[0] if getattr(arr, "shards", None) else arr.chunks[0]
    for a in range(0, arr.shape[0], step):
        crc = layout.crc32(arr[a : a + step], crc)
    return crc
