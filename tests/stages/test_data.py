"""Training batches from the store: what is read, in which order, by which rank."""

import dataclasses

import numpy as np
import pytest
import torch

from stages.train.data import (
    BUCKET,
    Ref,
    Refs,
    StoreBatches,
    epoch_batches,
    index_samples,
    refs_of,
)
from stages.train.recipe import BATCHINGS
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader


def refs(n=103):
    return Refs.of(np.zeros(n), np.arange(n), [10 + (i * 37) % 200 for i in range(n)])


# The algorithms as they were written with a Python object a sample (before the arrays): the
# arrays must give exactly their refs and batches, so that a seed trains on what it always did.

def reference_refs(arrays, shards, max_length):
    out = []
    for shard in shards:
        a = arrays[shard]
        for i, (length, first) in enumerate(zip(np.diff(a["offsets"]).tolist(), a["first_pairs"].tolist())):
            n = min(length, max_length)
            if 0 <= first and first + 2 <= n:
                out.append(Ref(shard, i, n))
    return out


def reference_batches(refs, batch_size, seed, epoch, rank=0, world=1, batching="bucketed", row_tokens=None):
    g = np.random.default_rng([seed, epoch])
    order = g.permutation(len(refs))
    if batching == "packed":
        rows, row, used = [], [], 0
        for r in [refs[i] for i in order]:
            if row and used + r.length > row_tokens:
                rows.append(tuple(row))
                row, used = [], 0
            row.append(r)
            used += r.length
        rows += [tuple(row)] if row else []
    elif batching == "random":
        rows = [(refs[i],) for i in order]
    else:
        rows = []
        for lo in range(0, len(order), batch_size * BUCKET):
            rows += [(refs[i],) for i in sorted(order[lo:lo + batch_size * BUCKET], key=lambda i: refs[i].length)]
    batches = [rows[j:j + batch_size] for j in range(0, len(rows), batch_size)]
    if batching == "bucketed":
        batches = [batches[i] for i in g.permutation(len(batches))]
    per_rank = len(batches) // world
    return batches[rank * per_rank:(rank + 1) * per_rank]


def synthetic_arrays(seed, shards=7, most=300):
    """Per-sample arrays of `shards` shards: lengths from 1 to ~4k tokens (many equal: ties in the
    length sort), first loss pairs anywhere in the sample or none (-1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for s in range(shards):
        n = int(rng.integers(0, most))
        lengths = np.where(rng.random(n) < 0.3, rng.integers(1, 40, n), rng.integers(1, 4096, n))
        first = np.where(rng.random(n) < 0.1, -1, (rng.random(n) * lengths).astype(np.int64))
        out[s] = {"offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                  "first_pairs": first.astype(np.int32)}
    return out


@pytest.mark.parametrize("seed", [0, 1, 7])
@pytest.mark.parametrize("max_length", [16, 512, 8192])
def test_the_refs_are_the_reference_algorithms(seed, max_length):
    arrays = synthetic_arrays(seed)
    shards = [5, 0, 3, 6, 1, 2, 4][:4 + seed % 4]
    got = refs_of(arrays, shards, max_length)
    assert got.shard.dtype == got.index.dtype == got.length.dtype == np.int32
    expected = reference_refs(arrays, shards, max_length)
    assert list(got) == expected and len(got) == len(expected) > 0


@pytest.mark.parametrize("batching", BATCHINGS)
@pytest.mark.parametrize("seed", [0, 3, 11])
def test_the_batches_are_the_reference_algorithms_bit_for_bit(batching, seed):
    """For every seed, epoch, batch size, deal and row budget, the same batches as the per-object
    algorithm: same rows, same samples, same order."""
    r = refs_of(synthetic_arrays(seed, shards=9, most=700), list(range(9)), 2048)
    listed = list(r)
    assert len(r) > 3 * 8 * BUCKET  # several bucketing windows
    for epoch, batch_size, world, row_tokens in [(0, 1, 1, 2048), (1, 3, 2, 4096), (2, 8, 3, 2048), (5, 5, 1, 9000)]:
        for rank in range(world):
            args = (batch_size, seed, epoch, rank, world, batching, row_tokens)
            got = epoch_batches(r, *args)
            assert list(got) == reference_batches(listed, *args), (epoch, batch_size, world, rank)
    assert epoch_batches(Refs.of([], [], []), 2, seed, 0, batching=batching, row_tokens=100) == []


def test_batches_formed_again_with_other_arguments_are_those_arguments_batches():
    """Refs remember the epoch they last formed and every epoch's count: asking again in any order,
    with one argument changed at a time, gives each time the reference algorithm's batches."""
    from stages.train.config import DataConfig
    from stages.train.data import epoch_length

    r = refs_of(synthetic_arrays(5, shards=4, most=400), list(range(4)), 2048)
    listed = list(r)
    asks = [(2, 0, 0, 0, 1, "packed", 2048), (2, 0, 0, 0, 1, "packed", 4096), (3, 0, 0, 0, 1, "packed", 4096),
            (3, 1, 0, 0, 1, "packed", 4096), (3, 1, 1, 0, 1, "packed", 4096), (3, 1, 1, 1, 2, "packed", 4096),
            (3, 1, 1, 1, 2, "bucketed", 4096), (3, 1, 1, 1, 2, "random", 4096), (2, 0, 0, 0, 1, "packed", 2048)]
    for args in asks + asks[::-1]:
        assert list(epoch_batches(r, *args)) == reference_batches(listed, *args), args
    for bs, seed, epoch, _, _, batching, row_tokens in asks:
        config = DataConfig(batch_size=bs, seed=seed, batching=batching, max_length=row_tokens)
        assert epoch_length(config, r, epoch) == len(reference_batches(listed, bs, seed, epoch, 0, 1, batching,
                                                                       row_tokens))


def test_a_sample_longer_than_the_row_budget_is_a_row_of_its_own_as_before():
    r = Refs.of(np.zeros(6), np.arange(6), [5, 30, 3, 3, 40, 2])
    got = list(epoch_batches(r, 1, 0, 0, batching="packed", row_tokens=10))
    assert got == reference_batches(list(r), 1, 0, 0, batching="packed", row_tokens=10)
    assert sorted(len(row) for (row,) in got) != [1] * 6  # some rows hold several samples


def test_refs_read_like_a_list_of_ref():
    from stages.train.data import sample_refs

    r = refs(10)
    assert r[3] == Ref(0, 3, r.length[3]) and r[-1] == list(r)[-1] and list(r[2:5]) == list(r)[2:5]
    assert list(r[[4, 1]]) == [list(r)[4], list(r)[1]] and list(r + r[:2]) == list(r) + list(r)[:2]
    assert r == refs(10) and r != refs(11) and r != r[::-1] and len(r) == 10
    held = sample_refs(r, 4, 0)
    assert len(held) == 4 and held == sample_refs(r, 4, 0) != sample_refs(r, 4, 1) and sample_refs(r, None, 0) == r
    assert list(held.index) == sorted(held.index)  # in store order


def batches_of(batching, r, *args):
    return epoch_batches(r, 4, *args, batching=batching, row_tokens=400)


@pytest.mark.parametrize("batching", BATCHINGS)
def test_order_is_deterministic_per_seed_and_epoch(batching):
    r = refs()
    assert len(batches_of(batching, r, 1, 0)) > 5
    assert batches_of(batching, r, 1, 0) == batches_of(batching, r, 1, 0)
    assert batches_of(batching, r, 1, 0) != batches_of(batching, r, 1, 1)
    assert batches_of(batching, r, 1, 0) != batches_of(batching, r, 2, 0)


@pytest.mark.parametrize("batching", BATCHINGS)
def test_ranks_read_disjoint_equal_parts(batching):
    r = refs()
    parts = [batches_of(batching, r, 0, 0, rank, 3) for rank in range(3)]
    assert len({len(p) for p in parts}) == 1
    seen = [ref for p in parts for b in p for row in b for ref in row]
    dropped = 3 * 4 * (1 if batching != "packed" else 400 // 10)  # at most the tail of 3 ranks' batches
    assert len(seen) == len(set(seen)) and len(seen) >= len(r) - dropped


def test_length_bucketing_keeps_padding_small():
    r = refs(1024)

    def waste(batches):
        return sum(max(x.length for (x,) in b) * len(b) - sum(x.length for (x,) in b) for b in batches)

    assert waste(epoch_batches(r, 8, 0, 0)) < 0.1 * waste(epoch_batches(r, 8, 0, 0, batching="random"))


def test_random_batches_follow_the_shuffled_order():
    r = refs(64)
    rows = [row for b in epoch_batches(r, 4, 3, 0, batching="random") for row in b]
    assert all(len(row) == 1 for row in rows)
    assert [x.index for (x,) in rows] == np.random.default_rng([3, 0]).permutation(64).tolist()


def test_packed_rows_hold_whole_samples_within_the_row_budget_in_shuffled_order():
    r = refs(200)
    batches = epoch_batches(r, 2, 5, 0, batching="packed", row_tokens=500)
    rows = [row for b in batches for row in b]
    assert all(len(b) == 2 for b in batches)
    assert all(sum(x.length for x in row) <= 500 for row in rows)
    assert any(len(row) > 2 for row in rows)
    order = np.random.default_rng([5, 0]).permutation(200).tolist()
    flat = [x.index for row in rows for x in row]
    assert flat == order[:len(flat)]  # consecutive samples of the shuffled order, none split or reordered
    for a, b in zip(rows, rows[1:]):  # a row is closed only when the next sample does not fit
        assert sum(x.length for x in a) + b[0].length > 500


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


@pytest.mark.parametrize("batching", BATCHINGS)
def test_the_shared_memory_need_bounds_every_batch_and_is_met_by_the_largest(small_store, batching):
    from stages.train.config import DataConfig
    from stages.train.data import PREFETCH, shared_memory_need

    store = HiddenStore(str(small_store))
    config = DataConfig(store=str(small_store), batch_size=3, max_length=60, workers=2, batching=batching)
    r = index_samples(store, [0, 1, 2, 3], config.max_length)
    need = shared_memory_need(config, r, len(store.attrs.taps), store.attrs.hidden_size, local_processes=8)
    per_batch, rest = divmod(need, 8 * config.workers * PREFETCH)
    batches = epoch_batches(r, 3, 0, 0, batching=batching, row_tokens=config.max_length)
    sizes = [StoreBatches(str(small_store), batches)[i].hidden.nbytes for i in range(len(batches))]
    assert rest == 0 and max(sizes) <= per_batch
    if batching != "packed":  # rows padded to the longest sample: a full batch holding it meets the bound
        longest = max(x.length for x in r)
        full = [i for i, b in enumerate(batches) if len(b) == 3 and longest in [x.length for row in b for x in row]]
        assert full and sizes[full[0]] == per_batch
    assert shared_memory_need(dataclasses.replace(config, workers=0), r, 5, 64, 8) == 0


def test_too_little_shared_memory_is_refused_in_one_line_naming_the_need_and_the_fix(tmp_path):
    import shutil

    from stages.train.config import DataConfig
    from stages.train.data import check_shared_memory
    from store.errors import ConfigError

    free = shutil.disk_usage(tmp_path).free
    check_shared_memory(DataConfig(workers=2), free // 2, str(tmp_path))  # fits: nothing said
    with pytest.raises(ConfigError) as e:
        check_shared_memory(DataConfig(workers=2), 2 * free, str(tmp_path))
    line = str(e.value)
    assert "\n" not in line and line.startswith("--workers 2: ") and str(tmp_path) in line
    assert "--shm-size=" in line and "--workers 0" in line


def test_the_index_is_the_same_from_held_records_in_the_shards_order(small_store):
    store = HiddenStore(str(small_store))
    alone = index_samples(store, [3, 0, 2, 1], 60)
    assert index_samples(store, [3, 0, 2, 1], 60, records=store.committed()) == alone
    assert [r.shard for r in alone] == sorted([r.shard for r in alone], key=[3, 0, 2, 1].index)


@pytest.mark.parametrize("batching", BATCHINGS)
def test_an_epochs_length_is_the_number_of_its_batches(batching):
    from stages.train.config import DataConfig
    from stages.train.data import epoch_length, train_batches

    for n in (1, 3, 4, 103):
        config = DataConfig(batch_size=4, batching=batching, max_length=400)
        assert [epoch_length(config, refs(n), e) for e in range(3)] == [len(train_batches(config, refs(n), e))
                                                                        for e in range(3)]


def test_one_loader_keeps_its_workers_and_their_shard_readers_through_the_epochs(small_store, tmp_path, monkeypatch):
    """Two epochs' batches through one loader of 2 workers: every shard's reader is opened once per
    worker (a new loader each epoch opened them all again in new processes), and the batches come
    in order, each equal to the same batch read alone."""
    import os

    from stages.train import data
    from stages.train.config import DataConfig

    opened = tmp_path / "opened"

    class Counting(ShardReader):
        def __init__(self, store, shard, record=None):
            with opened.open("a") as f:  # a worker is a forked process: it reports through a file
                f.write(f"{os.getpid()} {shard}\n")
            super().__init__(store, shard, record)

    monkeypatch.setattr(data, "ShardReader", Counting)
    store = HiddenStore(str(small_store))
    refs = index_samples(store, [0, 1, 2], 200)
    epochs = [epoch_batches(refs, 2, 0, e) for e in (0, 1)]
    config = DataConfig(store=str(small_store), workers=2, on_corrupt="stop")
    got = list(data.loader(config, (b for batches in epochs for b in batches), False, set()))
    want = [b for batches in epochs for b in batches]
    lines = [tuple(map(int, x.split())) for x in opened.read_text().splitlines()]
    assert len({pid for pid, _ in lines}) == 2  # the same two workers all along
    assert len(lines) == len(set(lines)) <= 2 * 3  # a reader per worker and shard, opened once
    assert len(got) == len(want)
    for batch, rows in list(zip(got, want))[::7]:
        alone = StoreBatches(str(small_store), [rows])[0]
        assert torch.equal(batch.tokens, alone.tokens) and torch.equal(batch.hidden.view(torch.int16),
                                                                       alone.hidden.view(torch.int16))
