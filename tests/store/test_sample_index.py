"""The per-sample arrays of many shards in one batch of reads: the arrays ShardReader reads, every
file checked, anything else read by ShardReader."""

import shutil

import numpy as np
import pytest

from store import sample_index
from store.errors import StoreCorrupt
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader

NAMES = ("offsets", "first_pairs", "row_ids", "prompt_lens")


def _no_reader(*a, **k):
    raise AssertionError("read by ShardReader")


def test_the_batch_gives_shard_readers_arrays_without_a_reader(small_store, monkeypatch):
    store = HiddenStore(str(small_store))
    records = store.committed()
    expected = {s: {n: getattr(ShardReader(store, s), n) for n in NAMES} for s in records}
    monkeypatch.setattr(sample_index, "ShardReader", _no_reader)  # schema 2: every shard read here
    got = sample_index.per_sample(store, records, NAMES)
    assert sorted(got) == sorted(records)
    for s in records:
        for n in NAMES:
            assert got[s][n].dtype == expected[s][n].dtype and np.array_equal(got[s][n], expected[s][n]), (s, n)


@pytest.mark.parametrize("what", ["offsets/c.0", "offsets/zarr.json", "first_pairs/c.0"])
@pytest.mark.parametrize("how", ["flip", "delete"])
def test_a_damaged_file_is_left_to_shard_reader_which_names_it(store_copy, what, how):
    path = store_copy / "shards/00002" / what
    if how == "delete":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x20
        path.write_bytes(bytes(data))
    store = HiddenStore(str(store_copy))
    records = store.committed()
    with pytest.raises(StoreCorrupt, match="shards/00002"):
        sample_index.per_sample(store, records)
    del records[2]
    assert sorted(sample_index.per_sample(store, records)) == [0, 1, 3]  # the others are fine


def test_an_old_layout_is_read_by_shard_reader(tmp_path):
    from tests.store.test_damage import SCHEMA1

    shutil.copytree(SCHEMA1, tmp_path / "s1.zarr")
    store = HiddenStore(str(tmp_path / "s1.zarr"))
    records = store.committed()
    got = sample_index.per_sample(store, records)  # blosc without crc32c, first_pairs computed
    for s in records:
        r = ShardReader(store, s)
        assert np.array_equal(got[s]["offsets"], r.offsets) and np.array_equal(got[s]["first_pairs"], r.first_pairs)
