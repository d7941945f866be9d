"""Format revision 5 names chunk files c.K.0.0 (no directory per key level); stores written before,
c/K/0/0, read exactly as they did.

tests/data/rev4_store: shards 0-1 of 64 written by format revision 4 (at 1fac12c: `pipeline extract
--store tests/data/rev4_store --shards 0-1 --max-new-tokens 16 --max-length 128 --chunk-tokens 32
--shard-tokens 64 --dtype fp32 --device cpu`, _locks/ left out). The same command run by this
revision gives the same values under other key names.
"""

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from store import sample_index
from store.format import layout
from store.format.read_checks import chunk_separator
from store.format.schema import FORMAT_REVISION
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader, read_samples
from store.verify import verify
from tests.store.test_damage import equal, read_everything

DATA_REV4 = Path(__file__).parents[1] / "data" / "rev4_store"
FIXTURE = dict(
    shards="0-1", max_new_tokens=16, max_length=128, chunk_tokens=32, shard_tokens=64, dtype="fp32", device="cpu"
)


def extract(path: Path, **over) -> None:
    from stages.extract.config import ExtractConfig
    from stages.extract.run import run

    run(ExtractConfig(store=str(path), **{**FIXTURE, **over}), log=lambda m: None)


@pytest.fixture(scope="module")
def rev4_store(tmp_path_factory) -> Path:
    """A copy of the fixture (reading it writes its index file)."""
    path = tmp_path_factory.mktemp("rev4") / "hs.zarr"
    shutil.copytree(DATA_REV4, path)
    return path


@pytest.fixture(scope="module")
def rev5_store(tmp_path_factory) -> Path:
    """The fixture's command, run by this revision."""
    path = tmp_path_factory.mktemp("rev5") / "hs.zarr"
    extract(path)
    return path


def _bf16(x) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16:
        return x
    if isinstance(x, np.ndarray) and x.dtype == np.uint16:  # bf16 bit patterns
        return torch.from_numpy(x.astype(np.int16)).view(torch.bfloat16)
    return None


def alike(a, b) -> bool:
    """equal, but for bf16 states: the fixture was written on another CPU, whose kernels round a few
    values (3e-4 of a store, more in one sample; bench/reports/cross_cpu_cpu_2026-12-05.md) one bf16
    step the other way."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(alike(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(alike(x, y) for x, y in zip(a, b))
    x, y = _bf16(a), _bf16(b)
    if x is None or y is None:
        return equal(a, b)
    if x.shape != y.shape:
        return False
    x, y = x.float(), y.float()
    off = x != y
    step = 2.0**-7 * torch.maximum(x.abs(), y.abs())
    return bool(off.float().mean() <= 1e-2 and ((x - y).abs() <= step + 1e-4)[off].all())  # 1e-4: values near 0


def inodes(folder: Path) -> tuple[int, int]:
    """(files, directories) under folder, itself included."""
    walked = list(os.walk(folder))
    return sum(len(f) for _, _, f in walked), len(walked)


def arrays_of(store: Path, shard: int) -> list[Path]:
    return sorted(p for p in (store / "shards" / f"{shard:05d}").iterdir() if p.is_dir())


def test_a_new_store_names_chunks_with_dots_and_takes_fewer_inodes(rev4_store, rev5_store):
    REV4 = rev4_store
    store = HiddenStore(str(rev5_store))
    assert store.attrs.format_revision == FORMAT_REVISION == 5
    for name in ("embed_tokens", "lm_head"):
        meta = json.loads((rev5_store / "target" / name / "zarr.json").read_text())
        assert meta["chunk_key_encoding"] == {"name": "default", "configuration": {"separator": "."}}
    for shard in (0, 1):
        assert store.commit_record(shard).chunk_separator == "."
        for array in arrays_of(rev5_store, shard):
            meta = json.loads((array / "zarr.json").read_text())
            assert meta["chunk_key_encoding"] == {"name": "default", "configuration": {"separator": "."}}, array
            assert not [p for p in array.iterdir() if p.is_dir()], array  # every chunk a file beside the metadata
            assert sorted(p.name for p in array.iterdir()) == sorted(
                ["zarr.json", *(p.name for p in array.glob("c.*"))]
            )
        new, old = inodes(rev5_store / "shards" / f"{shard:05d}"), inodes(REV4 / "shards" / f"{shard:05d}")
        assert new[0] == old[0]  # the same chunk files, named otherwise
        assert new[1] == 1 + len(arrays_of(rev5_store, shard)) < old[1]  # the shard's and its arrays' folders only
        # the old layout: a folder c, then one per key level of every chunk but the last
        hidden = REV4 / "shards" / f"{shard:05d}" / "hidden"
        assert inodes(hidden)[1] == 2 + 2 * inodes(hidden)[0] - 2  # c/K/0/0: c, c/K, c/K/0 (the metadata aside)


def test_the_old_layout_holds_the_same_values_and_reads_alike_through_every_path(rev4_store, rev5_store):
    REV4 = rev4_store
    old, new = HiddenStore(str(REV4)), HiddenStore(str(rev5_store))
    assert old.attrs.format_revision == 4 and all(old.commit_record(s).chunk_separator is None for s in (0, 1))
    assert all(chunk_separator(old.commit_record(s)) == "/" for s in (0, 1))
    # the same settings but the conv1d kernel, which revision 4 did not record: a revision-5 writer may add shards to it
    assert old.attrs.compat == dataclasses.replace(new.attrs.compat, conv1d=None) != new.attrs.compat
    # what training and evaluation read: root, embeddings, index file, records' contents, every sample
    a, b = read_everything(str(REV4), [0, 1]), read_everything(str(rev5_store), [0, 1])
    for got in (a, b):
        got.pop("attrs")
        got.pop("index")  # its records hold the runs' notes (hosts, times), compared below without them
        for s in (0, 1):
            got[s][0] = {
                k: v
                for k, v in got[s][0].to_json().items()
                if k in ("samples", "tokens", "shapes", "completion_tokens", "categories")
            }
    assert alike(a, b)  # the checksums (of the states) left out above
    for s in (0, 1):
        ro, rn = ShardReader(old, s), ShardReader(new, s)
        for k in ("tokens", "loss_mask"):  # zarr's own read, following each array's metadata
            assert np.array_equal(old.shard_arrays(s)[k][:], new.shard_arrays(s)[k][:]), (s, k)
        assert np.array_equal(ro.hidden[:], old.shard_arrays(s)["hidden"][:])  # the old layout's own reads agree
        assert alike(old.shard_arrays(s)["hidden"][:], new.shard_arrays(s)["hidden"][:])
        batch = [(r, i, None, None) for r in (ro, rn) for i in range(len(ro))]  # the batched span reads
        got = read_samples(batch)
        n = len(ro)
        for i in range(n):
            assert alike(got[i].hidden, got[n + i].hidden)
            assert torch.equal(got[i].tokens, got[n + i].tokens) and torch.equal(got[i].loss_mask, got[n + i].loss_mask)
            assert torch.equal(got[i].hidden.view(torch.int16), ro[i].hidden.view(torch.int16))
    for store in (old, new):  # the sample index reads both layouts' per-sample chunks in its one batch
        records = store.committed()
        readers = {s: ShardReader(store, s) for s in records}
        with pytest.MonkeyPatch.context() as m:  # none left to ShardReader: the chunk keys were named right
            m.setattr(sample_index, "ShardReader", None)
            direct = sample_index.per_sample(store, records)
        assert all(equal(direct[s], {n: getattr(readers[s], n) for n in ("offsets", "first_pairs")}) for s in records)
    assert verify(old).ok and verify(new).ok


def test_a_missing_chunk_file_is_damage_in_both_layouts(tmp_path, rev4_store, rev5_store):
    """Every chunk was written (revision 3 on): a deleted one is named by verify and by the readers."""
    for src, victim in ((rev4_store, "shards/00001/hidden/c/1/0/0"), (rev5_store, "shards/00001/hidden/c.1.0.0")):
        path = tmp_path / src.parent.name
        shutil.copytree(src, path)
        (path / victim).unlink()
        report = verify(HiddenStore(str(path)))
        assert not report.ok and any("shard 1" in line or "00001" in line for line in report.lines()), report.lines()
        reader = ShardReader(HiddenStore(str(path)), 1)
        with pytest.raises(Exception, match=victim.replace(".", r"\.")):
            for i in range(len(reader)):
                reader[i]


def test_a_revision_5_shard_added_to_a_revision_4_store_reads_beside_the_old_ones(tmp_path, rev5_store):
    path = tmp_path / "mixed.zarr"
    shutil.copytree(DATA_REV4, path)
    extract(path, shards="2")
    store = HiddenStore(str(path))
    assert store.attrs.format_revision == 4  # the root stays as it was made
    assert [chunk_separator(store.commit_record(s)) for s in (0, 1, 2)] == ["/", "/", "."]
    assert (path / "shards/00002/offsets/c.0").is_file() and (path / "shards/00001/offsets/c/0").is_file()
    records = store.committed()
    with pytest.MonkeyPatch.context() as m:  # each shard's chunk named by its own record
        m.setattr(sample_index, "ShardReader", None)
        direct = sample_index.per_sample(store, records)
    for s in (0, 1, 2):
        reader = ShardReader(store, s)
        assert np.array_equal(direct[s]["offsets"], reader.offsets)
        assert all(len(reader[i].tokens) == reader.offsets[i + 1] - reader.offsets[i] for i in range(len(reader)))
    assert verify(store).ok
    assert layout.chunk_key(".", 2, 0, 0) == "c.2.0.0" and layout.chunk_key("/", 0) == "c/0"


def test_a_run_with_another_shard_file_size_is_told_the_store_s(tmp_path):
    """--shard-tokens is part of a store's settings, and its default grew (4096 -> 16384) with revision 5:
    adding shards to an older store with the default is refused with the flag to pass."""
    from store.errors import StoreMismatch

    path = tmp_path / "old.zarr"
    shutil.copytree(DATA_REV4, path)
    over = {k: v for k, v in FIXTURE.items() if k != "shard_tokens"}
    with pytest.raises(StoreMismatch, match="shard_tokens: store has 64, this run has 16384.*pass --shard-tokens 64"):
        from stages.extract.config import ExtractConfig
        from stages.extract.run import run

        run(ExtractConfig(store=str(path), **{**over, "shards": "2"}), log=lambda m: None)
