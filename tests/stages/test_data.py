"""Training batches from the store: what is read, in which order, by which rank."""

import numpy as np
import pytest
import torch

from stages.train.data import Ref, StoreBatches, epoch_batches, index_samples
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader


def refs(n=103):
    return [Ref(0, i, 10 + (i * 37) % 200) for i in range(n)]


def test_order_is_deterministic_per_seed_and_epoch():
    r = refs()
    assert epoch_batches(r, 4, seed=1, epoch=0) == epoch_batches(r, 4, seed=1, epoch=0)
    assert epoch_batches(r, 4, seed=1, epoch=0) != epoch_batches(r, 4, seed=1, epoch=1)
    assert epoch_batches(r, 4, seed=1, epoch=0) != epoch_batches(r, 4, seed=2, epoch=0)


def test_ranks_read_disjoint_equal_parts():
    r = refs()
    parts = [epoch_batches(r, 4, 0, 0, rank, 3) for rank in range(3)]
    assert len({len(p) for p in parts}) == 1
    seen = [ref for p in parts for b in p for ref in b]
    assert len(seen) == len(set(seen)) and len(seen) >= len(r) - 3 * 4  # only the tail is dropped


def test_length_bucketing_keeps_padding_small():
    r = refs(1024)
    waste = lambda batches: sum(max(x.length for x in b) * len(b) - sum(x.length for x in b) for b in batches)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(r), generator=g).tolist()
    random = [[r[i] for i in order[j:j + 8]] for j in range(0, len(r), 8)]
    assert waste(epoch_batches(r, 8, 0, 0)) < 0.1 * waste(random)


def test_batches_hold_exactly_the_stored_samples(small_store):
    store = HiddenStore(str(small_store))
    r = index_samples(store, [0, 1, 2, 3], max_length=30)
    assert r and all(x.length <= 30 for x in r)
    batch = StoreBatches(str(small_store), [r[:3]])[0]
    for j, ref in enumerate(r[:3]):
        s = ShardReader(store, ref.shard)[ref.index]
        n = ref.length
        assert torch.equal(batch.tokens[j, :n], s.tokens[:n]) and torch.equal(batch.hidden[j, :n], s.hidden[:n])
        assert torch.equal(batch.loss_mask[j, :n], s.loss_mask[:n]) and not batch.loss_mask[j, n:].any()
        assert batch.refs[j].tolist() == [ref.shard, ref.index]


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
            if n >= 2 and anchor_mask(mask[off[i]:off[i] + n]).any():
                expected.append((shard, i, n))
    read = []
    real = ShardReader._array
    monkeypatch.setattr(ShardReader, "_array", lambda self, name: read.append(name) or real(self, name))
    got = [(r.shard, r.index, r.length) for r in index_samples(store, list(store.committed()), max_length)]
    assert got == expected and (got or max_length == 8)
    assert not {"tokens", "loss_mask"} & set(read)


def test_a_sample_is_read_as_its_own_span(small_store, monkeypatch):
    """Reading samples never loads a shard's whole per-token arrays: a loader worker's memory is
    bounded by its batch, whatever the store's size."""
    read = []
    real = ShardReader._array
    monkeypatch.setattr(ShardReader, "_array", lambda self, name: read.append(name) or real(self, name))
    reader = ShardReader(HiddenStore(str(small_store)), 1)
    samples = [reader[i] for i in range(len(reader))]
    assert set(read) == {"offsets", "row_ids", "prompt_lens"}
    g = HiddenStore(str(small_store)).shard_arrays(1)
    assert torch.equal(torch.cat([s.tokens for s in samples]), torch.from_numpy(g["tokens"][:].astype(np.int64)))
