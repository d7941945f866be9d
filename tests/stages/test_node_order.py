"""The node-affine order (--data-order node): each node's ranks read only the node's shards, every
sample at most once an epoch, shards on their node until the next deal, a shuffle window's worth of
shards in use at once, and a resumed run continuing with exactly the batches still to come."""

import dataclasses

import numpy as np
import pytest

from stages.train.config import DataConfig
from stages.train.epoch_order import BUCKET, epoch_length, train_batches
from stages.train.node_order import check_shards, deal_shards, node_layout
from stages.train.position import Position, advance, rank_batches
from stages.train.recipe import BATCHINGS
from stages.train.samples import Refs
from store.errors import ConfigError


def shard_refs(shards=24, low=20, high=90, seed=0):
    """Shards of low..high samples each (shard ids not in order, not contiguous), lengths 10-300."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(low, high, shards)
    ids = rng.permutation(shards) * 3 + 1
    shard = np.repeat(ids, counts)
    index = np.concatenate([np.arange(c) for c in counts])
    return Refs.of(shard, index, rng.integers(10, 300, len(shard)))


REFS = shard_refs()


def config(batching, **kw):
    return DataConfig(batch_size=3, seed=5, batching=batching, max_length=400, data_order="node", **kw)


def read(c, refs, position, epoch, world, local, micro=None):
    """What each rank of a launch of `world` processes, `local` a node, reads of `epoch` from `position`."""
    return [list(rank_batches(c, refs, position, epoch, r, world, local))[:micro] for r in range(world)]


def samples(batches):
    return [(x.shard, x.index) for b in batches for row in b for x in row]


def ids(per_rank):
    return [tuple(samples([b])) for batches in per_rank for b in batches]


@pytest.mark.parametrize("batching", BATCHINGS)
@pytest.mark.parametrize("world,local", [(6, 2), (4, 4), (8, 2), (3, 1)])
def test_each_nodes_ranks_read_only_its_shards_and_each_sample_at_most_once(batching, world, local):
    c = config(batching, shuffle_window=3)
    nodes = world // local
    largest = int(np.bincount(REFS.shard).max())
    for epoch in range(3):
        per_rank = read(c, REFS, Position(), epoch, world, local)
        assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) > 0
        shards = [{s for s, _ in samples(per_rank[r])} for r in range(world)]
        node_shards = [set().union(*shards[n * local : (n + 1) * local]) for n in range(nodes)]
        assert all(a.isdisjoint(b) for i, a in enumerate(node_shards) for b in node_shards[i + 1 :])
        seen = [s for b in per_rank for s in samples(b)]
        assert len(seen) == len(set(seen))  # at most once
        # all but the trimmed tail: per node at most the gap to the smallest node (under the largest
        # shard: the deal is balanced) and less than a batch for each of its ranks
        most_a_row = 1 if batching != "packed" else 400 // 10
        assert len(seen) >= len(REFS) - nodes * (largest + c.batch_size * local * most_a_row)


def test_the_deal_balances_the_nodes_sample_counts_within_the_largest_shard():
    counts = np.random.default_rng(1).integers(1, 500, 97)
    for nodes in (1, 2, 3, 7):
        dealt = deal_shards(counts, nodes, seed=4, deal_round=0)
        load = np.bincount(dealt, weights=counts, minlength=nodes)
        assert load.sum() == counts.sum() and load.max() - load.min() <= counts.max()
        assert np.array_equal(dealt, deal_shards(counts, nodes, seed=4, deal_round=0))


def node_sets(c, epoch, world=6, local=2):
    per_rank = read(c, REFS, Position(), epoch, world, local)
    return [
        frozenset(s for r in range(n * local, (n + 1) * local) for s, _ in samples(per_rank[r]))
        for n in range(world // local)
    ]


@pytest.mark.parametrize("batching", BATCHINGS)
def test_shards_stay_on_their_node_for_redeal_every_epochs_and_are_dealt_anew_after(batching):
    every = [node_sets(config(batching, redeal_every=2), e) for e in range(6)]
    # a node's shard set may lose a few shards to the trimmed tail: compare the sets' owners
    owner = [{s: n for n, ss in enumerate(sets) for s in ss} for sets in every]

    def same_deal(a, b):
        return all(owner[a][s] == owner[b][s] for s in owner[a].keys() & owner[b].keys())

    assert same_deal(0, 1) and same_deal(2, 3) and same_deal(4, 5)
    assert not same_deal(1, 2) and not same_deal(3, 4)
    once = [node_sets(config(batching), e) for e in range(4)]  # redeal_every 0: one deal for the run
    owner = [{s: n for n, ss in enumerate(sets) for s in ss} for sets in once]
    assert all(same_deal(0, e) for e in range(1, 4))
    assert read(config(batching), REFS, Position(), 0, 6, 2) != read(config(batching), REFS, Position(), 1, 6, 2)


def most_open(shards_in_order):
    """The most shards in use at once along a read sequence: at each point between two samples, the
    shards read both before and after it."""
    seq = np.asarray(shards_in_order)
    if not len(seq):
        return 0
    first = {s: i for i, s in reversed(list(enumerate(seq)))}
    last = {s: i for i, s in enumerate(seq)}
    change = np.zeros(len(seq) + 1, dtype=np.int64)
    for s in first:  # open from just after its first sample to its last one
        change[first[s] + 1] += 1
        change[last[s] + 1] -= 1
    return int(np.cumsum(change).max())


@pytest.mark.parametrize("batching", BATCHINGS)
@pytest.mark.parametrize("window", [1, 2, 5])
def test_a_rank_has_at_most_a_windows_shards_in_use_at_once(batching, window):
    """Along each rank's read order (and along each node's: its ranks' batches one after the other),
    the shards read both before and after any point number at most `window`: the node reads window
    after window. Bucketed batches are shuffled within buckets of BUCKET batches, each of
    batch_size * BUCKET consecutive samples of the node's order; a bucket no longer than the
    smallest window spans at most two windows, hence at most 2 * window shards in use. Without a
    window the same measure reaches about every shard of the node."""
    refs = shard_refs(shards=30, low=260, high=400, seed=2)  # every window >= 260 samples >= a bucket (256)
    c = dataclasses.replace(config(batching, shuffle_window=window), batch_size=4)
    assert c.batch_size * BUCKET <= 260
    bound = window * (2 if batching == "bucketed" else 1)
    for world, local in [(1, 1), (4, 2)]:
        per_rank = read(c, refs, Position(), 0, world, local)
        for r in range(world):
            assert most_open([s for s, _ in samples(per_rank[r])]) <= bound
        for n in range(world // local):
            assert most_open([s for r in range(n * local, (n + 1) * local) for s, _ in samples(per_rank[r])]) <= bound
    whole = read(dataclasses.replace(c, shuffle_window=None), refs, Position(), 0, 1, 1)[0]
    assert most_open([s for s, _ in samples(whole)]) > 20  # the measure sees a global shuffle


@pytest.mark.parametrize("batching", BATCHINGS)
@pytest.mark.parametrize(
    "before,after", [((4, 2), (4, 2)), ((4, 2), (2, 1)), ((4, 2), (6, 2)), ((2, 1), (3, 3)), ((1, 1), (4, 2))]
)
def test_a_run_resumed_mid_epoch_continues_with_exactly_the_batches_still_to_come(batching, before, after):
    """Saved after 3 batches a rank on `before` = (world, local), resumed on `after`: the epoch is
    formed with the saved layout (the position records it), no batch of it read twice, none lost
    but the deals' tails; on the same launch every rank reads exactly what it would have; the next
    epoch is formed with the new launch's nodes."""
    c = config(batching, shuffle_window=2)
    (w0, l0), (w1, l1) = before, after
    whole = ids([train_batches(c, REFS, 0, layout=node_layout(w0, l0))])  # the epoch's global batch list
    first = read(c, REFS, Position(), 0, w0, l0, 3)
    at = advance(c, REFS, Position(), 3, w0, l0)
    assert at.layout == node_layout(w0, l0) and Position.from_json(at.to_json()) == at
    rest = read(c, REFS, Position.from_json(at.to_json()), 0, w1, l1)
    got = ids(first) + ids(rest)
    assert len(got) == len(set(got)) and set(got) <= set(whole)
    assert len(whole) - len(got) < w0 + w1
    if before == after:
        assert [a + b for a, b in zip(first, rest)] == read(c, REFS, Position(), 0, w0, l0)
    # the next epoch: the new launch's layout, dealt to its ranks as a fresh run would deal it
    assert read(c, REFS, at, 1, w1, l1) == read(c, REFS, Position(), 1, w1, l1)
    later = advance(c, REFS, Position.from_json(at.to_json()), len(rest[0]) + 2, w1, l1)
    assert later.epoch == 1 and later.layout == node_layout(w1, l1)
    assert read(c, REFS, later, 1, w1, l1) == [b[2:] for b in read(c, REFS, Position(), 1, w1, l1)]


def test_an_epochs_length_under_the_node_order_is_the_number_of_its_batches():
    for batching in BATCHINGS:
        for layout in [(1, 1), (2, 2), (3, 1), (4, 2)]:
            c = config(batching, shuffle_window=4)
            for e in range(2):
                assert epoch_length(c, REFS, e, layout) == len(train_batches(c, REFS, e, layout=layout)) > 0
                assert epoch_length(c, REFS, e, layout) % (layout[0] * layout[1]) == 0


@pytest.mark.parametrize("batching", BATCHINGS)
def test_the_global_order_ignores_the_layout_and_saves_positions_as_before(batching):
    c = DataConfig(batch_size=3, seed=5, batching=batching, max_length=400)
    assert train_batches(c, REFS, 1, layout=(4, 2)) == train_batches(c, REFS, 1)
    assert read(c, REFS, Position(), 0, 4, 2) == read(c, REFS, Position(), 0, 4, 1)
    at = advance(c, REFS, Position(), 5, 4, 2)
    assert at.layout is None and set(at.to_json()) == {"epoch", "remaining"}
    assert Position.from_json({"epoch": 2, "remaining": [[3, 9]]}) == Position(2, ((3, 9),))  # an old checkpoint's


def test_the_node_orders_settings_are_checked():
    with pytest.raises(ConfigError, match="--shuffle-window"):
        DataConfig(shuffle_window=4)  # global order: no window
    with pytest.raises(ConfigError, match="--redeal-every"):
        DataConfig(redeal_every=2)
    with pytest.raises(ConfigError, match="--shuffle-window"):
        DataConfig(data_order="node", shuffle_window=0)
    with pytest.raises(ConfigError, match="--data-order"):
        DataConfig(data_order="shard")
    with pytest.raises(ConfigError, match="3 nodes need at least as many training shards; the run has 2"):
        check_shards(config("random"), np.array([4, 4, 9]), (3, 2))
    check_shards(config("random"), np.array([4, 4, 9]), (2, 2))
    check_shards(DataConfig(), np.array([4]), (3, 2))  # the global order: any number of shards
    assert node_layout(8, 4) == (2, 4) and node_layout(6, 4) == (1, 6) and node_layout(1, 1) == (1, 1)
