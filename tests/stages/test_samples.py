"""Sample refs (stages/train/samples.py): which samples of the store are indexed, read like a list."""

import numpy as np
import pytest

from stages.train.samples import Ref, Refs, index_samples, refs_of
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader


def refs(n=103):
    return Refs.of(np.zeros(n), np.arange(n), [10 + (i * 37) % 200 for i in range(n)])


# The algorithm as it was written with a Python object a sample (before the arrays): the arrays
# must give exactly its refs, so that a seed trains on what it always did (the batches' algorithm:
# tests/stages/test_epoch_order.py).


def reference_refs(arrays, shards, max_length):
    out = []
    for shard in shards:
        a = arrays[shard]
        for i, (length, first) in enumerate(zip(np.diff(a["offsets"]).tolist(), a["first_pairs"].tolist())):
            n = min(length, max_length)
            if 0 <= first and first + 2 <= n:
                out.append(Ref(shard, i, n))
    return out


def synthetic_arrays(seed, shards=7, most=300):
    """Per-sample arrays of `shards` shards: lengths from 1 to ~4k tokens (many equal: ties in the
    length sort), first loss pairs anywhere in the sample or none (-1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for s in range(shards):
        n = int(rng.integers(0, most))
        lengths = np.where(rng.random(n) < 0.3, rng.integers(1, 40, n), rng.integers(1, 4096, n))
        first = np.where(rng.random(n) < 0.1, -1, (rng.random(n) * lengths).astype(np.int64))
        out[s] = {
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            "first_pairs": first.astype(np.int32),
        }
    return out


@pytest.mark.parametrize("seed", [0, 1, 7])
@pytest.mark.parametrize("max_length", [16, 512, 8192])
def test_the_refs_are_the_reference_algorithms(seed, max_length):
    arrays = synthetic_arrays(seed)
    shards = [5, 0, 3, 6, 1, 2, 4][: 4 + seed % 4]
    got = refs_of(arrays, shards, max_length)
    assert got.shard.dtype == got.index.dtype == got.length.dtype == np.int32
    expected = reference_refs(arrays, shards, max_length)
    assert list(got) == expected and len(got) == len(expected) > 0


def test_refs_read_like_a_list_of_ref():
    from stages.train.samples import sample_refs

    r = refs(10)
    assert r[3] == Ref(0, 3, r.length[3]) and r[-1] == list(r)[-1] and list(r[2:5]) == list(r)[2:5]
    assert list(r[[4, 1]]) == [list(r)[4], list(r)[1]] and list(r + r[:2]) == list(r) + list(r)[:2]
    assert r == refs(10) and r != refs(11) and r != r[::-1] and len(r) == 10
    held = sample_refs(r, 4, 0)
    assert len(held) == 4 and held == sample_refs(r, 4, 0) != sample_refs(r, 4, 1) and sample_refs(r, None, 0) == r
    assert list(held.index) == sorted(held.index)  # in store order


def test_samples_without_a_completion_are_not_indexed(small_store):
    store = HiddenStore(str(small_store))
    r = index_samples(store, [0, 1, 2, 3], max_length=10_000)
    total = sum(len(ShardReader(store, s)) for s in range(4))
    kept = {(x.shard, x.index) for x in r}
    for s in range(4):
        reader = ShardReader(store, s)
        for i in range(len(reader)):
            lm = reader[i].loss_mask
            assert ((s, i) in kept) == bool((lm[:-1] & lm[1:]).any())
    assert 0 < len(r) <= total


@pytest.mark.parametrize("max_length", [8, 40, 2048])
def test_the_index_reads_no_per_token_array_and_equals_a_scan_of_the_masks(small_store, max_length, monkeypatch):
    """index_samples builds from the per-sample index (first_pairs): same samples and lengths as
    scanning every loss mask with the anchor rule, without reading tokens or masks."""
    from pipeline.drafter.blocks import anchor_mask

    store = HiddenStore(str(small_store))
    expected = []
    for shard in store.committed():
        g = store.shard_arrays(shard)
        off, mask = g["offsets"][:], g["loss_mask"][:].astype(bool)
        for i in range(len(off) - 1):
            n = min(int(off[i + 1] - off[i]), max_length)
            if n >= 2 and anchor_mask(mask[off[i] : off[i] + n]).any():
                expected.append((shard, i, n))
    read = []
    real = ShardReader._array
    monkeypatch.setattr(ShardReader, "_array", lambda self, name: read.append(name) or real(self, name))
    got = [(r.shard, r.index, r.length) for r in index_samples(store, list(store.committed()), max_length)]
    assert got == expected and (got or max_length == 8)
    assert not {"tokens", "loss_mask"} & set(read)


def test_the_index_is_the_same_from_held_records_in_the_shards_order(small_store):
    store = HiddenStore(str(small_store))
    alone = index_samples(store, [3, 0, 2, 1], 60)
    assert index_samples(store, [3, 0, 2, 1], 60, records=store.committed()) == alone
    assert [r.shard for r in alone] == sorted([r.shard for r in alone], key=[3, 0, 2, 1].index)
