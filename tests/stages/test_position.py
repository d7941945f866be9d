"""Where a run is in its data: resumed on any number of processes, no batch of an epoch is read twice
and none is lost beyond the tail a deal drops; on the same number, every rank reads what it would have."""

import numpy as np
import pytest

from stages.train.config import DataConfig
from stages.train.position import Position, advance, rank_batches, to_ranges
from stages.train.recipe import BATCHINGS
from stages.train.samples import Refs

REFS = Refs.of(np.zeros(150), np.arange(150), [10 + (i * 37) % 200 for i in range(150)])


def config(batching):
    return DataConfig(batch_size=4, seed=3, batching=batching, max_length=400)


def read(c, position, epoch, world, micro):
    """What each of `world` ranks reads of `epoch` from `position`: its first `micro` batches (None: all)."""
    return [list(rank_batches(c, REFS, position, epoch, r, world))[:micro] for r in range(world)]


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


def reference_ranges(indices):
    out = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1][1] += 1
        else:
            out.append([i, i + 1])
    return tuple((a, b) for a, b in out)


def test_ranges_are_the_ascending_runs_in_order():
    for indices in ([], [4], [0, 1, 2, 7, 8, 3, 4, 9], [5, 4, 3], [2, 3, 3, 4]):
        assert to_ranges(np.array(indices, dtype=np.int64)) == reference_ranges(indices)
    assert to_ranges(np.array([0, 1, 2, 7, 8, 3])) == ((0, 3), (7, 9), (3, 4))


@pytest.mark.parametrize("batching", BATCHINGS)
def test_a_saved_position_is_what_the_per_object_walk_gave(batching):
    """advance's positions (what step-N records and --resume reads) equal the list walk's of before
    the arrays, at every micro-batch of three epochs, on 1 to 3 ranks, from a resumed position too."""
    c = config(batching)

    def walked(position, micro, world):  # the walk as it was written with lists
        epoch = position.epoch
        while True:
            n = len(rank_batches(c, REFS, Position(), epoch, 0, 1))
            indices = (
                list(range(n))
                if epoch > position.epoch or position.remaining is None
                else [i for lo, hi in position.remaining for i in range(lo, hi)]
            )
            per = len(indices) // world
            if micro < per:
                return Position(
                    epoch, reference_ranges([i for r in range(world) for i in indices[r * per + micro : (r + 1) * per]])
                )
            micro, epoch = micro - per, epoch + 1
            if micro == 0:
                return Position(epoch, None)

    for world in (1, 2, 3):
        for micro in range(0, 3 * 40 // world, 3):
            assert advance(c, REFS, Position(), micro, world) == walked(Position(), micro, world)
    resumed = advance(c, REFS, Position(), 7, 2)
    assert all(advance(c, REFS, resumed, m, 3) == walked(resumed, m, 3) for m in range(0, 30, 2))


def test_epochs_walked_counts_each_epoch_in_its_own_batches():
    """Epochs of different sizes (--follow): an epoch counts 1 however many batches it has; with one
    size throughout, the walk agrees with epochs_done's count of epoch 0's batches."""
    from stages.train.config import DataConfig
    from stages.train.position import Position, epochs_done, epochs_walked
    from stages.train.samples import Refs

    config = DataConfig(store="s", batch_size=1)
    small, large = Refs.of([0] * 8, range(8), [10] * 8), Refs.of([0] * 24, range(24), [10] * 24)
    sizes = {0: small, 1: small, 2: large}
    by_epoch = lambda e: sizes.get(e, large)  # noqa: E731
    assert epochs_walked(config, by_epoch, Position(), 4, 2) == 1.0  # epoch 0: 8 batches, 4 a rank
    assert epochs_walked(config, by_epoch, Position(), 8, 2) == 2.0
    assert epochs_walked(config, by_epoch, Position(), 14, 2) == 2.5  # 6 of epoch 2's 12 a rank
    for micro in (1, 3, 4, 7):
        assert epochs_walked(config, small, Position(), micro, 2) == epochs_done(micro, 1, 4)
