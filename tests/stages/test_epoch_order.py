"""An epoch's order (stages/train/epoch_order.py): which samples each batch holds, in which order,
for which rank."""

import numpy as np
import pytest

from stages.train.epoch_order import BUCKET, epoch_batches
from stages.train.recipe import BATCHINGS
from stages.train.samples import Refs, refs_of
from tests.stages.test_samples import refs, synthetic_arrays

# The algorithm as it was written with a Python object a sample (before the arrays): the arrays
# must give exactly its batches, so that a seed trains on what it always did.


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
            rows += [(refs[i],) for i in sorted(order[lo : lo + batch_size * BUCKET], key=lambda i: refs[i].length)]
    batches = [rows[j : j + batch_size] for j in range(0, len(rows), batch_size)]
    if batching == "bucketed":
        batches = [batches[i] for i in g.permutation(len(batches))]
    per_rank = len(batches) // world
    return batches[rank * per_rank : (rank + 1) * per_rank]


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
    from stages.train.epoch_order import epoch_length

    r = refs_of(synthetic_arrays(5, shards=4, most=400), list(range(4)), 2048)
    listed = list(r)
    asks = [
        (2, 0, 0, 0, 1, "packed", 2048),
        (2, 0, 0, 0, 1, "packed", 4096),
        (3, 0, 0, 0, 1, "packed", 4096),
        (3, 1, 0, 0, 1, "packed", 4096),
        (3, 1, 1, 0, 1, "packed", 4096),
        (3, 1, 1, 1, 2, "packed", 4096),
        (3, 1, 1, 1, 2, "bucketed", 4096),
        (3, 1, 1, 1, 2, "random", 4096),
        (2, 0, 0, 0, 1, "packed", 2048),
    ]
    for args in asks + asks[::-1]:
        assert list(epoch_batches(r, *args)) == reference_batches(listed, *args), args
    for bs, seed, epoch, _, _, batching, row_tokens in asks:
        config = DataConfig(batch_size=bs, seed=seed, batching=batching, max_length=row_tokens)
        assert epoch_length(config, r, epoch) == len(
            reference_batches(listed, bs, seed, epoch, 0, 1, batching, row_tokens)
        )


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


@pytest.mark.parametrize("batching", BATCHINGS)
def test_an_epochs_length_is_the_number_of_its_batches(batching):
    from stages.train.config import DataConfig
    from stages.train.epoch_order import epoch_length, train_batches

    for n in (1, 3, 4, 103):
        config = DataConfig(batch_size=4, batching=batching, max_length=400)
        assert [epoch_length(config, refs(n), e) for e in range(3)] == [
            len(train_batches(config, refs(n), e)) for e in range(3)
        ]
