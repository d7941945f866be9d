"""The index file: built once per state of the commits, read instead of every shard's files, and
never used when the commits changed or any check fails."""

import shutil

import fsspec
import numpy as np
import pytest

from store import index_file, sample_index
from store.format import layout
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader
from store.store_writer import StoreWriter


def _equal(a: index_file.StoreIndex, b: index_file.StoreIndex) -> bool:
    return (
        a.records == b.records
        and a.arrays.keys() == b.arrays.keys()
        and all(
            a.arrays[s].keys() == b.arrays[s].keys()
            and all(
                a.arrays[s][n].dtype == b.arrays[s][n].dtype and np.array_equal(a.arrays[s][n], b.arrays[s][n])
                for n in a.arrays[s]
            )
            for s in a.arrays
        )
    )


@pytest.fixture
def store_copy(store_copy):
    """A copy of the small store without the index file other tests' training runs left in it."""
    shutil.rmtree(store_copy / index_file.FOLDER, ignore_errors=True)
    return store_copy


def _reads_no_shard(monkeypatch):
    """From here on reading a commit file or a shard's per-sample arrays fails the test."""

    def fail(*a, **k):
        raise AssertionError("a shard's own files were read")

    monkeypatch.setattr(HiddenStore, "committed", fail)
    monkeypatch.setattr(index_file, "per_sample", fail)


def test_the_second_load_reads_one_file_and_gives_what_the_shards_give(store_copy, monkeypatch):
    store = HiddenStore(str(store_copy))
    first, note = index_file.load(store)
    assert "built" in note and "saved to" in note, note
    records = store.committed()
    assert first.records == records
    expected = {s: {n: getattr(ShardReader(store, s), n) for n in index_file.NAMES} for s in records}
    assert _equal(first, index_file.StoreIndex(records, expected))
    assert [p.name for p in (store_copy / index_file.FOLDER).iterdir()] == [f"samples-{index_file.state(store)}.npz"]
    _reads_no_shard(monkeypatch)
    second, note = index_file.load(HiddenStore(str(store_copy)))
    assert note.startswith("sample index of 4 shards read from"), note
    assert _equal(second, first)


def test_a_new_commit_is_a_new_state_and_the_old_file_goes(store_copy):
    store = StoreWriter(str(store_copy))
    record = store.commit_record(3)
    (store_copy / layout.commit_key(3)).unlink()
    shard_3_gone, _ = index_file.load(store)
    assert sorted(shard_3_gone.records) == [0, 1, 2]
    old = index_file.state(store)
    store.write_json(layout.commit_key(3), record.to_json())  # committed again
    assert index_file.state(store) != old
    again, note = index_file.load(store)
    assert "built" in note and sorted(again.records) == [0, 1, 2, 3]
    assert [p.name for p in (store_copy / index_file.FOLDER).iterdir()] == [f"samples-{index_file.state(store)}.npz"]


def test_a_rewritten_commit_file_is_a_new_state(store_copy):
    """Same name, same size, other content: the listing's inode and modification time differ."""
    store = StoreWriter(str(store_copy))
    index_file.load(store)
    old = index_file.state(store)
    path = store_copy / layout.commit_key(2)
    before = path.read_bytes()
    store.write_json(layout.commit_key(2), store.commit_record(2).to_json())
    assert path.read_bytes() == before and index_file.state(store) != old


def test_a_damaged_file_is_never_used_but_built_again(store_copy):
    store = HiddenStore(str(store_copy))
    good, _ = index_file.load(store)
    key = index_file.state(store)
    path = store_copy / index_file.file_key(key)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    assert index_file.read(store, key) is None
    again, note = index_file.load(store)
    assert "built" in note and _equal(again, good) and index_file.read(store, key) is not None


def test_a_sealed_file_whose_arrays_disagree_with_the_commit_records_is_not_used(store_copy):
    """A file that passes its own crc32c (written by other code, say) but holds another array."""
    store = HiddenStore(str(store_copy))
    good, _ = index_file.load(store)
    key = index_file.state(store)
    wrong = {s: dict(a) for s, a in good.arrays.items()}
    wrong[1]["first_pairs"] = wrong[1]["first_pairs"] + 1
    (store_copy / index_file.file_key(key)).write_bytes(
        index_file.encode(key, index_file.StoreIndex(good.records, wrong))
    )
    assert index_file.read(store, key) is None
    again, note = index_file.load(store)
    assert "built" in note and _equal(again, good)


def test_a_file_of_another_state_is_not_used(store_copy):
    store = HiddenStore(str(store_copy))
    good, _ = index_file.load(store)
    key = index_file.state(store)
    other = "0" * 16
    (store_copy / index_file.file_key(other)).write_bytes(index_file.encode(key, good))  # renamed to another state
    assert index_file.read(store, other) is None


def test_a_store_it_cannot_write_to_is_read_the_long_way(store_copy):
    (store_copy / index_file.FOLDER).write_text("not a folder")  # saving fails as on read-only credentials
    store = HiddenStore(str(store_copy))
    index, note = index_file.load(store)
    assert "could not save it" in note and "the next launch reads them again" in note
    assert index.records == store.committed()


def test_a_listing_without_versions_keeps_no_file(small_store):
    """fsspec's memory file system lists names and sizes only."""
    fs = fsspec.filesystem("memory")
    fs.put(str(small_store), "/index-test/hs.zarr", recursive=True)
    if fs.exists("/index-test/hs.zarr/_index"):  # left by other tests' training runs
        fs.rm("/index-test/hs.zarr/_index", recursive=True)
    try:
        store = HiddenStore("memory://index-test/hs.zarr")
        assert index_file.state(store) is None
        index, note = index_file.load(store)
        assert "no index file is kept" in note and sorted(index.records) == sorted(store.committed())
        assert not fs.exists("/index-test/hs.zarr/_index")
        assert index.arrays.keys() == sample_index.per_sample(store, store.committed()).keys()
    finally:
        fs.rm("/index-test", recursive=True)
