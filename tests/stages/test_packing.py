"""Packed rows (stages/train/packing.py, --batching packed): whole samples, consecutive in the
shuffled order, as many a row as fit."""

import numpy as np

from stages.train.epoch_order import epoch_batches
from stages.train.samples import Refs
from tests.stages.test_epoch_order import reference_batches
from tests.stages.test_samples import refs


def test_a_sample_longer_than_the_row_budget_is_a_row_of_its_own_as_before():
    r = Refs.of(np.zeros(6), np.arange(6), [5, 30, 3, 3, 40, 2])
    got = list(epoch_batches(r, 1, 0, 0, batching="packed", row_tokens=10))
    assert got == reference_batches(list(r), 1, 0, 0, batching="packed", row_tokens=10)
    assert sorted(len(row) for (row,) in got) != [1] * 6  # some rows hold several samples


def test_packed_rows_hold_whole_samples_within_the_row_budget_in_shuffled_order():
    r = refs(200)
    batches = epoch_batches(r, 2, 5, 0, batching="packed", row_tokens=500)
    rows = [row for b in batches for row in b]
    assert all(len(b) == 2 for b in batches)
    assert all(sum(x.length for x in row) <= 500 for row in rows)
    assert any(len(row) > 2 for row in rows)
    order = np.random.default_rng([5, 0]).permutation(200).tolist()
    flat = [x.index for row in rows for x in row]
    assert flat == order[: len(flat)]  # consecutive samples of the shuffled order, none split or reordered
    for a, b in zip(rows, rows[1:]):  # a row is closed only when the next sample does not fit
        assert sum(x.length for x in a) + b[0].length > 500
