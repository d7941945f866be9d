"""Opening a store and a shard on an object store waits for few rounds of requests, and reads what
zarr reads.

The store is served from memory through a file system that counts its calls: a call that fetches a
batch of files (cat_ranges: one request each, all in flight together on S3) is one round, as is any
other call (a file's bytes, a listing, a size); zarr's own reads go through the same file system, so
a read that fell back to zarr, or a metadata file zarr fetched again, would show.
"""

import threading
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch
import zarr
from fsspec.implementations.memory import MemoryFileSystem

from store.hidden_store import HiddenStore
from store.io import zarr_files
from store.shard_reader import ShardReader, read_samples

SCHEMA1 = Path(__file__).parents[1] / "data" / "schema1_store"
PER_SAMPLE = ("offsets", "prompt_lens", "row_ids", "first_pairs")
_depth = threading.local()


class CountedFS(MemoryFileSystem):
    """fsspec's memory file system under its own protocol, counting its top-level calls (rounds) and
    the files they ask for (requests)."""

    protocol = "counted"
    rounds: list = []  # (call, files) per top-level call

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("counted://") if isinstance(path, str) else path)

    def cat_ranges(self, paths, starts, ends, *args, **kwargs):
        return self._counted("cat_ranges", len(paths), super().cat_ranges, paths, starts, ends, *args, **kwargs)

    def _counted(self, name, files, call, *args, **kwargs):
        top = not getattr(_depth, "n", 0)
        if top:
            CountedFS.rounds.append((name, files))
        _depth.n = getattr(_depth, "n", 0) + 1
        try:
            return call(*args, **kwargs)
        finally:
            _depth.n -= 1


for _name in ("cat_file", "cat", "_open", "info", "ls", "exists", "isfile", "isdir", "find", "du"):

    def _wrapped(self, *args, _name=_name, **kwargs):
        return self._counted(_name, 1, getattr(MemoryFileSystem, _name).__get__(self), *args, **kwargs)

    setattr(CountedFS, _name, _wrapped)
fsspec.register_implementation("counted", CountedFS, clobber=True)


@pytest.fixture
def served():
    """A local store copied into the counted file system: its URL."""
    names = []

    def copy(src: Path) -> str:
        name = f"/counted-{len(names)}-{id(names)}"
        fs = CountedFS()
        for f in src.rglob("*"):
            if f.is_file():
                fs.pipe_file(f"{name}/{f.relative_to(src)}", f.read_bytes())
        names.append(name)
        return f"counted://{name}"

    yield copy
    for key in [k for k in MemoryFileSystem.store if any(k.startswith(f"{n}/") for n in names)]:
        del MemoryFileSystem.store[key]


def bits(x: torch.Tensor) -> np.ndarray:
    """A bf16 tensor's bits, as zarr stores them."""
    return x.view(torch.int16).numpy().view(np.uint16)


def rounds(fn) -> tuple[list, object]:
    """(the rounds fn waited for, what it returned)."""
    CountedFS.rounds.clear()
    got = fn()
    return list(CountedFS.rounds), got


def test_a_shard_opens_in_one_round_and_its_first_sample_in_two_more(served, small_store):
    url = served(small_store)
    store = HiddenStore(url)
    store.attrs
    records = store.committed()
    want = zarr.open_group(str(small_store), mode="r")
    for shard, record in records.items():
        opened, reader = rounds(lambda: ShardReader(store, shard, record))
        assert opened == [("cat_ranges", 12)], opened  # 8 metadata files, 4 per-sample chunks
        first, sample = rounds(lambda: reader[0])
        assert [r[0] for r in first] == ["cat_ranges", "cat_ranges"], (
            first
        )  # chunk indexes and token chunks, then states
        group = want[f"shards/{shard:05d}"]
        offsets = group["offsets"][:]
        for i in range(len(reader)):  # bit for bit what zarr reads
            s = reader[i]
            a, b = offsets[i], offsets[i + 1]
            assert np.array_equal(s.tokens.numpy(), group["tokens"][a:b])
            assert np.array_equal(s.loss_mask.numpy(), group["loss_mask"][a:b].astype(bool))
            assert np.array_equal(bits(s.hidden), group["hidden"][a:b])
            assert s.row_id == group["row_ids"][i] and s.prompt_len == group["prompt_lens"][i]
        for name in PER_SAMPLE:
            got = getattr(reader, name)
            assert got.dtype == group[name].dtype and np.array_equal(got, group[name][:]), name
    assert sample.tokens.numel() > 0


def test_the_root_and_both_embeddings_take_a_round_each(served, small_store):
    store = HiddenStore(served(small_store))
    root, attrs = rounds(lambda: store.attrs)
    assert root == [("cat_ranges", 5)], root  # the root commit and the 4 metadata files it vouches for
    tables, (embed, head) = rounds(lambda: store.embeddings(("embed_tokens", "lm_head")))
    assert tables == [("cat_ranges", 2)], tables  # both arrays' chunks (their metadata came with the root)
    want = zarr.open_group(str(small_store), mode="r")
    for got, name in ((embed, "embed_tokens"), (head, "lm_head")):
        assert got.dtype == torch.bfloat16 and np.array_equal(bits(got), want[f"target/{name}"][:])
    assert attrs == HiddenStore(str(small_store)).attrs


def test_training_opens_a_shard_without_its_record_in_two_rounds(served, small_store):
    store = HiddenStore(served(small_store))
    store.attrs
    opened, reader = rounds(lambda: ShardReader(store, 2))
    assert [r[0] for r in opened] == ["cat_file", "cat_ranges"], opened  # its commit file, then the rest
    assert np.array_equal(reader.offsets, ShardReader(HiddenStore(str(small_store)), 2).offsets)


def test_a_batch_of_samples_of_several_shards_takes_two_rounds(served, small_store):
    store = HiddenStore(served(small_store))
    store.attrs
    readers = [ShardReader(store, s, r) for s, r in store.committed().items()]
    items = [(r, i, None, None) for r in readers for i in range(min(3, len(r)))]
    batch, got = rounds(lambda: read_samples(items))
    assert len(batch) == 2 and not any(isinstance(x, Exception) for x in got), batch


def test_old_layouts_are_read_through_zarr_as_before(served):
    """Schema 1 (blosc, no chunk checksums): per-sample arrays and spans fall back to zarr."""
    store = HiddenStore(served(SCHEMA1))
    want = zarr.open_group(str(SCHEMA1), mode="r")
    for shard, record in store.committed().items():
        reader = ShardReader(store, shard, record)
        group = want[f"shards/{shard:05d}"]
        for name in ("offsets", "prompt_lens", "row_ids"):
            assert np.array_equal(getattr(reader, name), group[name][:]), name
        offsets = group["offsets"][:]
        for i in range(len(reader)):
            s = reader[i]
            assert np.array_equal(s.tokens.numpy(), group["tokens"][offsets[i] : offsets[i + 1]])


def test_arrays_read_whole_in_batches_equal_one_batch(small_store):
    """read_whole's batches (a bound on what is held at once) change nothing in what it reads."""
    store = HiddenStore(str(small_store))
    store.attrs
    arrays = [
        (
            store.path(f"target/{n}"),
            zarr_files.parse(store._root_files[f"target/{n}/zarr.json"], store.path(f"target/{n}/zarr.json")),
        )
        for n in ("embed_tokens", "lm_head")
    ]
    whole = zarr_files.read_whole(store.fs, arrays)
    rows = arrays[0][1].chunk_grid.chunk_shape[0]
    for bound in (1, rows * 128 * 2, 10**12):
        got = zarr_files.read_whole(store.fs, arrays, round_bytes=bound)
        assert all(np.array_equal(a, b) for a, b in zip(got, whole)), bound
    want = zarr.open_group(str(small_store), mode="r")
    assert np.array_equal(whole[1], want["target/lm_head"][:])
