"""Padded batches read from the store (stages/train/dataset.py): exactly the stored samples, each
read as its own span."""

import numpy as np
import torch

from stages.train.dataset import StoreBatches
from stages.train.samples import index_samples
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader


def test_batches_hold_exactly_the_stored_samples(small_store):
    store = HiddenStore(str(small_store))
    r = index_samples(store, [0, 1, 2, 3], max_length=30)
    assert r and all(x.length <= 30 for x in r)
    batch = StoreBatches(str(small_store), [[(x,) for x in r[:3]]])[0]
    for j, ref in enumerate(r[:3]):
        s = ShardReader(store, ref.shard)[ref.index]
        n = ref.length
        assert torch.equal(batch.tokens[j, :n], s.tokens[:n]) and torch.equal(batch.hidden[j, :n], s.hidden[:n])
        assert torch.equal(batch.loss_mask[j, :n], s.loss_mask[:n]) and not batch.loss_mask[j, n:].any()
        assert batch.refs[j].tolist() == [ref.shard, ref.index]
    assert not batch.starts.any()


def test_a_packed_row_holds_its_samples_back_to_back(small_store):
    store = HiddenStore(str(small_store))
    r = index_samples(store, [0, 1, 2, 3], max_length=30)[:5]
    batch = StoreBatches(str(small_store), [[tuple(r[:3]), tuple(r[3:])]])[0]
    assert batch.refs.tolist() == [[x.shard, x.index] for x in r]
    for j, row in enumerate([r[:3], r[3:]]):
        at = 0
        for ref in row:
            s, n = ShardReader(store, ref.shard)[ref.index], ref.length
            span = slice(at, at + n)
            assert torch.equal(batch.tokens[j, span], s.tokens[:n]) and torch.equal(batch.hidden[j, span], s.hidden[:n])
            assert torch.equal(batch.loss_mask[j, span], s.loss_mask[:n]) and (batch.starts[j, span] == at).all()
            at += n
        assert int(batch.lengths[j]) == at and not batch.loss_mask[j, at:].any()


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


def test_a_dataset_sent_to_a_spawned_worker_leaves_its_store_behind_and_opens_its_own(small_store):
    """StoreBatches given the process's open store pickles without it (nor its readers), and the copy
    reads the same batch through a store it opens, at the same location."""
    import pickle

    store = HiddenStore(str(small_store))
    rows = [[(x,) for x in index_samples(store, [0, 1], 200)[:3]]]
    here = StoreBatches(store, rows)
    a = here[0]
    assert here.store is store and here._readers
    sent = pickle.loads(pickle.dumps(here))
    assert sent._store is None and not sent._readers
    b = sent[0]
    assert sent.store is not store and sent.store.location == store.location
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.hidden.view(torch.int16), b.hidden.view(torch.int16))
