"""Where a run is in its data: resumed on any number of processes, no batch of an epoch is read twice
and none is lost beyond the tail a deal drops; on the same number, every rank reads what it would have."""

import pytest

from stages.train.config import TrainConfig
from stages.train.data import Ref
from stages.train.position import Position, advance, rank_batches
from stages.train.recipe import BATCHINGS

REFS = [Ref(0, i, 10 + (i * 37) % 200) for i in range(150)]


def config(batching):
    return TrainConfig(batch_size=4, seed=3, batching=batching, max_length=400)


def read(c, position, epoch, world, micro):
    """What each of `world` ranks reads of `epoch` from `position`: its first `micro` batches (None: all)."""
    return [rank_batches(c, REFS, position, epoch, r, world)[:micro] for r in range(world)]


def ids(batches):
    return [tuple(x.index for row in b for x in row) for per_rank in batches for b in per_rank]


@pytest.mark.parametrize("batching", BATCHINGS)
@pytest.mark.parametrize("before,after", [(2, 1), (1, 2), (3, 2), (2, 2)])
def test_a_run_resumed_on_another_world_reads_each_batch_of_the_epoch_once(batching, before, after):
    c = config(batching)
    whole = ids(read(c, Position(), 0, 1, None))  # the epoch's global batch list
    first = read(c, Position(), 0, before, 3)
    at = advance(c, REFS, Position(), 3, before)
    rest = read(c, at, 0, after, None)
    got = ids(first) + ids(rest)
    assert len(got) == len(set(got)) and set(got) <= set(whole)  # never twice
    assert len(whole) - len(got) < before + after  # only the tails of the two deals are dropped
    if before == after:  # the same world: every rank goes on exactly where it was
        uninterrupted = read(c, Position(), 0, before, None)
        assert [a + b for a, b in zip(first, rest)] == uninterrupted


@pytest.mark.parametrize("batching", BATCHINGS)
def test_advancing_across_epochs_equals_reading_them(batching):
    c = config(batching)
    per = len(rank_batches(c, REFS, Position(), 0, 0, 2))
    at = advance(c, REFS, Position(), per + 5, 2)  # an epoch and five batches
    assert at.epoch == 1 and read(c, at, 1, 2, None) == [b[5:] for b in read(c, Position(), 1, 2, None)]
    assert advance(c, REFS, Position(), per, 2) == Position(1, None)
    assert advance(c, REFS, at, 0, 2) == at
    assert Position.from_json(at.to_json()) == at
