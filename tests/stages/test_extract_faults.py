"""A full disk at any point of an extraction, a target that yields NaN or Inf, and the free-space
check before anything is written. Disk faults are injected in-process at the lowest write of each
path (no real disk is filled): OSError(ENOSPC) from the Nth write whose path matches, once."""

from __future__ import annotations

import errno
import json
import os
from collections import namedtuple
from pathlib import Path

import pytest
import torch
import zarr

from pipeline.errors import TargetError
from stages.extract import disk_space
from stages.extract.config import ExtractConfig
from stages.extract.run import run
from stages.extract.summary import render
from store.errors import StoreError
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader
from store.store_writer import StoreWriter
from store.verify import verify
from tests.conftest import SMALL, assert_stores_equal, small_rows
from tests.processes import cli_args
from tests.targets import chat_prompt
from tests.test_cli import one_error_line, run_main

SHARD = 1  # cleared from a copy of the small store, then extracted again under the fault


class DiskFull:
    """Fires once: the write after `after` successful writes whose path contains `match`."""

    def __init__(self, match: str, after: int = 0) -> None:
        self.match, self.after, self.seen, self.fired = match, after, 0, False

    def hit(self, path) -> bool:
        if self.fired or self.match not in str(path):
            return False
        self.seen += 1
        self.fired = self.seen > self.after
        return self.fired

    @staticmethod
    def error(path) -> OSError:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def fail_state_files(monkeypatch, fault: DiskFull) -> None:
    """Whole state files, written by the writer thread (StoreWriter.write_pieces): half the file
    reaches the disk, then ENOSPC."""
    real = StoreWriter.write_pieces

    def write_pieces(self, key, pieces):
        if fault.hit(key):
            real(self, key, pieces[: len(pieces) // 2])
            raise fault.error(self.path(key))
        return real(self, key, pieces)

    monkeypatch.setattr(StoreWriter, "write_pieces", write_pieces)


def fail_zarr_writes(monkeypatch, fault: DiskFull) -> None:
    """Everything zarr writes to a local store (its lowest write, on zarr's own threads): the
    partial last state file, the per-sample arrays at commit, metadata."""
    local = zarr.storage._local
    real = local._put

    def put(path, value, exclusive=False):
        if fault.hit(path):
            raise fault.error(path)
        return real(path, value, exclusive)

    monkeypatch.setattr(local, "_put", put)


def fail_commit_file(monkeypatch, fault: DiskFull) -> None:
    """The commit file: its temporary file is left torn, the rename never happens."""
    real = StoreWriter.write_json

    def write_json(self, key, obj):
        if fault.hit(key):
            Path(f"{self.path(key)}.tmp.{os.getpid()}").write_text(json.dumps(obj)[:40])
            raise fault.error(self.path(key))
        return real(self, key, obj)

    monkeypatch.setattr(StoreWriter, "write_json", write_json)


FAULTS = {
    "first_state_file": (fail_state_files, f"shards/0000{SHARD}/hidden/", 0),
    "second_state_file": (fail_state_files, f"shards/0000{SHARD}/hidden/", 1),
    "last_state_file_through_zarr": (fail_zarr_writes, f"shards/0000{SHARD}/hidden/c.", 0),
    "tokens_array_at_commit": (fail_zarr_writes, f"shards/0000{SHARD}/tokens/c.", 0),
    "commit_file": (fail_commit_file, f"_commits/0000{SHARD}.json", 0),
}


def without_shard(store: Path, shard: int) -> StoreWriter:
    s = StoreWriter(str(store))
    s.clear_shard(shard)
    return s


@pytest.mark.parametrize("point", FAULTS)
def test_a_full_disk_stops_with_one_line_and_a_rerun_completes_the_store(
    point, small_store, store_copy, small_dataset, monkeypatch, capsys
):
    """Shard 1 is extracted again into a copy of the small store whose other shards are committed;
    the disk fills up at `point`. One line names the store, the space still needed and the way on;
    no shard without all its data has a commit file; verify passes; a rerun without the fault gives
    the uninterrupted store, file for file."""
    store = without_shard(store_copy, SHARD)
    inject, match, after = FAULTS[point]
    fault = DiskFull(match, after)
    inject(monkeypatch, fault)
    code, _, err = run_main(monkeypatch, capsys, cli_args(store_copy, small_dataset, "0-3"))
    assert fault.fired and code == 2
    line = one_error_line(err)
    assert line.startswith(f"error: {store_copy}: no space left on device; the shards still to write need about ")
    assert "KiB: committed" in line
    assert line.endswith(
        "committed shards are kept, the shard in progress is left uncommitted; free space and "
        "rerun the same command to complete the store"
    )
    assert "space: 1 shard(s) to write need about" in err  # the estimate, printed before the run
    assert list(store.committed()) == [0, 2, 3] and store.has_data(SHARD)
    assert verify(store).ok
    assert not list((store_copy / "_locks").glob("*.lock"))

    summary = run(
        ExtractConfig(store=str(store_copy), dataset=str(small_dataset), shards="0-3", num_shards=4, **SMALL),
        log=lambda m: None,
    )
    assert summary["shards_written"] == [SHARD]
    assert_stores_equal(store_copy, small_store)
    for f in (p for p in (small_store / f"shards/0000{SHARD}").rglob("*") if p.is_file()):
        assert f.read_bytes() == (store_copy / f.relative_to(small_store)).read_bytes(), f


def test_a_full_disk_is_found_however_it_is_wrapped():
    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise full
        except OSError as e:
            raise RuntimeError("writer for shard 3 failed") from e
    except RuntimeError as wrapped:
        assert disk_space.full_disk(wrapped) is full
    quota = OSError(errno.EDQUOT, "Disk quota exceeded")
    try:
        try:
            raise quota
        except OSError:
            raise KeyError("while writing")  # an implicit context, as a handler that fails leaves it
    except KeyError as wrapped:
        assert disk_space.full_disk(wrapped) is quota
    assert disk_space.full_disk(OSError(errno.EACCES, "denied")) is None
    assert disk_space.full_disk(RuntimeError("other")) is None


def test_too_little_free_space_is_refused_before_anything_is_written(tmp_path, small_dataset, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda path: usage(10 << 20, (10 << 20) - 3000, 3000))
    path = tmp_path / "new" / "hs.zarr"
    config = dict(store=str(path), dataset=str(small_dataset), shards="0", num_shards=4, **SMALL)
    with pytest.raises(StoreError) as e:
        run(ExtractConfig(**config), log=lambda m: None)
    message = str(e.value)
    assert message.startswith(f"{path}: not enough free space: 1 shard(s) to write need about ")
    assert f"and 2.9 KiB is free at {tmp_path}; " in message
    assert message.endswith("pass --ignore-free-space to start anyway")
    assert "\n" not in message and not path.exists()
    lines = []
    summary = run(ExtractConfig(**config, ignore_free_space=True), log=lines.append)
    assert summary["shards_written"] == [0]
    assert any(
        line.startswith("space: 1 shard(s) to write need about ")
        and line.endswith(
            "2.9 KiB free at " + str(tmp_path) + "; less than the estimate, going on (--ignore-free-space)"
        )
        for line in lines
    ), lines


def test_the_estimate_bounds_the_real_size_from_the_limits_and_from_committed_shards(
    small_store, fp8_store, small_dataset, target, tmp_path
):
    """A new store is estimated from the length limits, a store with committed shards from their
    recorded bytes; both lie above what the shards really took, and within a small factor of it
    (an fp8 store's states at their own, smaller fraction)."""
    from pipeline import prompts

    store = HiddenStore(str(small_store))
    committed = store.committed()
    real = sum(r.bytes["shard"] for r in committed.values())
    prompt_set = prompts.load(str(small_dataset))
    rows = {s: prompt_set.shard_rows(s, 4) for s in committed}
    config = ExtractConfig(store=str(tmp_path / "new.zarr"), dataset=str(small_dataset), num_shards=4, **SMALL)
    fresh = disk_space.needed(config, HiddenStore(config.store), target, store.attrs, prompt_set, rows, {})
    assert real < sum(fresh.shards.values()) < 3 * real, (fresh, real)
    assert fresh.root == int(2 * 4096 * 128 * 2 * disk_space.STORED_FRACTION) + 1
    assert fresh.basis.endswith(
        "tokens per row at the length limits x 5 taps x 128 x 2 bytes, stored at 0.70 of raw bf16"
    )
    measured = disk_space.needed(config, store, target, store.attrs, prompt_set, rows, committed)
    assert real < measured.total < 1.5 * real and measured.root == 0
    assert "per row measured over 4 committed shard(s), +20%" in measured.basis
    fp8 = disk_space.needed(
        config, HiddenStore(config.store), target, HiddenStore(str(fp8_store)).attrs, prompt_set, rows, {}
    )
    real_fp8 = sum(r.bytes["shard"] for r in HiddenStore(str(fp8_store)).committed().values())
    assert real_fp8 < sum(fp8.shards.values()) < sum(fresh.shards.values()) and fp8.root == fresh.root
    assert fp8.basis.endswith("stored at 0.45 of raw bf16")
    assert measured.left({0, 1}) == measured.shards[2] + measured.shards[3]


def test_free_space_is_checked_only_on_local_paths():
    lines = []
    need = disk_space.Need({0: 5 << 30}, 0, "a test")
    disk_space.check(HiddenStore("memory://nowhere/hs.zarr"), need, False, lines.append)
    assert lines == [
        (
            "space: 1 shard(s) to write need about 5.0 GiB (a test); memory://nowhere/hs.zarr is not a "
            "local path, free space not checked"
        )
    ]


NAN_ROW = 5  # in shard 1 of the small store (rows 4-7)


@pytest.fixture
def nan_capture(monkeypatch, target):
    """The target's capture, with a NaN in one state of NAN_ROW's sequence (patched in the test)."""
    from pipeline.target.model import Target

    prompt = chat_prompt(target.tokenizer, small_rows()[NAN_ROW]["messages"][:1])
    real = Target.capture

    def capture(self, seqs, taps, prompt_lens=None, **kwargs):
        out = real(self, seqs, taps, prompt_lens, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
        start = 0
        for seq in seqs:
            if seq[: len(prompt)] == prompt:
                with torch.inference_mode():
                    hidden[start + 2, 1, 7] = float("nan")
            start += len(seq)
        return out

    monkeypatch.setattr(Target, "capture", capture)


def test_nonfinite_states_stop_the_shard_naming_the_row_or_are_skipped_and_counted(
    nan_capture, small_store, store_copy, small_dataset
):
    store = without_shard(store_copy, SHARD)
    config = dict(store=str(store_copy), dataset=str(small_dataset), shards="0-3", num_shards=4, **SMALL)
    with pytest.raises(TargetError) as e:
        run(ExtractConfig(**config), log=lambda m: None)
    assert str(e.value) == (
        f"{store_copy}: shard {SHARD}: the target's hidden states hold NaN or Inf for dataset "
        f"row(s) {NAN_ROW}; the shard is not committed (pass --skip-nonfinite to leave such "
        "rows out and count them)"
    )
    assert list(store.committed()) == [0, 2, 3]

    summary = run(ExtractConfig(**config, skip_nonfinite=True), log=lambda m: None)
    record = store.commit_record(SHARD)
    assert record.skipped["nonfinite"] == 1 and summary["skipped"]["nonfinite"] == 1
    assert "skipped rows: prompt_too_long 1, nonfinite 1;" in render(summary)
    assert verify(store).ok
    reference = {s.row_id: s for s in ShardReader(HiddenStore(str(small_store)), SHARD)}
    got = {s.row_id: s for s in ShardReader(store, SHARD)}
    assert sorted(got) == sorted(set(reference) - {NAN_ROW})
    for row, s in got.items():  # the other rows of the batch, untouched
        assert torch.equal(s.tokens, reference[row].tokens) and torch.equal(s.hidden, reference[row].hidden), row
