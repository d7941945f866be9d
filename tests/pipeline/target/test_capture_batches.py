import pytest

from pipeline.target.capture_batches import GDN_BLOCK, capture_batches, chunks

LENGTHS = [26, 31, 30, 29, 33, 40, 78, 5, 40, 300]


@pytest.mark.parametrize("budget", [None, 1, 17, 64, 100, 200, 1000, 10**6])
def test_every_row_once_longest_first_within_the_budget(budget):
    batches = capture_batches(LENGTHS, budget)
    rows = [i for b in batches for i in b.rows]
    assert sorted(rows) == list(range(len(LENGTHS)))
    assert [LENGTHS[i] for i in rows] == sorted(LENGTHS, reverse=True)
    for b in batches:
        assert b.width == max(LENGTHS[i] for i in b.rows)
        assert b.tokens <= (budget or b.tokens) or len(b.rows) == 1  # only a row alone may pass the budget
    if budget is not None:  # greedy: the next batch's first row did not fit beside the previous batch
        for prev, nxt in zip(batches, batches[1:]):
            assert (len(prev.rows) + 1) * prev.width > budget


def test_no_rows_no_batches():
    assert capture_batches([], 64) == [] and capture_batches([], None) == []


@pytest.mark.parametrize(("width", "budget"), [(300, 100), (300, 64), (300, 1000), (300, 17), (129, 128), (64, 64)])
def test_chunks_cover_the_row_on_block_boundaries(width, budget):
    got = chunks(width, budget)
    assert got[0][0] == 0 and got[-1][1] == width
    assert all(a[1] == b[0] for a, b in zip(got, got[1:]))
    assert all(hi - lo <= budget for lo, hi in got)
    if budget >= GDN_BLOCK:
        assert all(lo % GDN_BLOCK == 0 for lo, _ in got)
    assert len(got) == (1 if width <= budget else -(-width // (budget // GDN_BLOCK * GDN_BLOCK or budget)))
