"""The node-affine sample order of an epoch (--data-order node): which samples each node reads, in
which order, so that a node reads only its share of the shards and a node-local cache fetches that
share once per deal rather than the whole store every epoch.

Shards are dealt to nodes by a (seed, deal round) generator, balanced by their sample counts (the
shards in a random order, each to the node with the fewest samples so far); the
deal round is epoch // --redeal-every (0 for the whole run when it is 0). Within a node, an epoch
shuffles the node's shards by (seed, epoch, node), groups them into windows of --shuffle-window
shards and shuffles the samples within each window. epoch_order.py forms the rows and batches of each
node's order and concatenates the nodes' sections; each of the node's ranks reads a contiguous
block of its node's order, window after window, so it has at most a window's shards in use at once
(the node: a window for each of its ranks; docs/training.md, Node-affine order).
Numpy only: a Python step per shard, none per sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from store.errors import ConfigError

if TYPE_CHECKING:
    from stages.train.config import DataConfig

DATA_ORDERS = ("global", "node")


@dataclass(frozen=True)
class NodeOrder:
    nodes: int  # the nodes an epoch's samples are dealt to
    local: int  # training processes a node: each node's section of batches is a multiple of it
    window: int | None  # shards whose samples are shuffled together; None: all of a node's shards
    redeal_every: int  # epochs a deal of shards to nodes lasts; 0: the whole run

    def __post_init__(self) -> None:
        assert (
            self.nodes >= 1 and self.local >= 1 and (self.window is None or self.window >= 1) and self.redeal_every >= 0
        ), self

    def deal_round(self, epoch: int) -> int:
        return epoch // self.redeal_every if self.redeal_every else 0


def check_shards(config: DataConfig, shard: np.ndarray, layout: tuple[int, int]) -> None:
    """Refuse, naming the counts, a node order with more nodes than training shards (a node without
    a shard would leave every node's section empty)."""
    shards = len(shard_counts(shard))
    if config.data_order == "node" and layout[0] > shards:
        raise ConfigError(
            "--data-order",
            config.data_order,
            f"{layout[0]} nodes need at least as many training shards; the run has {shards} (use --data-order global)",
        )


def node_layout(world: int, local: int) -> tuple[int, int]:
    """(nodes, processes a node) of a launch of `world` processes, `local` of them on each node
    (LOCAL_WORLD_SIZE); a launch whose processes are not spread evenly counts as one node."""
    if local < 1 or world % local:
        return 1, world
    return world // local, local


def deal_shards(counts: np.ndarray, nodes: int, seed: int, deal_round: int) -> np.ndarray:
    """[K] samples of each shard -> [K] the node each shard is dealt to: the shards in a random
    order, each to the node with the fewest samples so far (ties: the lowest node). The nodes' sample
    counts then differ by at most the largest shard's (true before each shard is dealt, and the one
    it goes to was the smallest). Not largest first: that would fix the deal by the counts alone."""
    g = np.random.default_rng([seed, 2, deal_round])
    load = np.zeros(nodes, dtype=np.int64)
    node = np.empty(len(counts), dtype=np.int64)
    for k in g.permutation(len(counts)).tolist():
        n = int(np.argmin(load))
        node[k], load[n] = n, load[n] + counts[k]
    return node


def node_samples(shard: np.ndarray, seed: int, epoch: int, order: NodeOrder) -> list[np.ndarray]:
    """[N] the shard of each sample -> per node, the positions of its samples in its epoch order:
    its shards shuffled and grouped into windows of order.window shards, each window's samples
    shuffled, window after window."""
    by_shard = np.argsort(shard, kind="stable")  # [N] samples grouped by shard, shards ascending
    counts = shard_counts(shard)
    starts = np.cumsum(counts) - counts  # [K] where each shard's samples begin in by_shard
    dealt = deal_shards(counts, order.nodes, seed, order.deal_round(epoch))
    out = []
    for n in range(order.nodes):
        g = np.random.default_rng([seed, 3, epoch, n])
        mine = np.flatnonzero(dealt == n)
        mine = mine[g.permutation(len(mine))]  # [k] this node's shards in this epoch's order
        lengths = counts[mine]
        total = int(lengths.sum())
        # [total] positions in by_shard, shard after shard in this order
        within = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        at = np.repeat(starts[mine], lengths) + within
        window = np.repeat(np.arange(len(mine)) // (order.window or max(len(mine), 1)), lengths)
        out.append(by_shard[at[shuffled_within(window, g)]])
    return out


def shard_counts(shard: np.ndarray) -> np.ndarray:
    """[N] the shard of each sample -> [K] samples of each shard present, shards ascending."""
    counts = np.bincount(shard) if len(shard) else np.zeros(0, np.int64)
    return counts[counts > 0]


def node_counts(shard: np.ndarray, seed: int, epoch: int, order: NodeOrder) -> np.ndarray:
    """[nodes] samples dealt to each node in `epoch` (what node_samples gives each, without forming the order)."""
    counts = shard_counts(shard)
    return np.bincount(
        deal_shards(counts, order.nodes, seed, order.deal_round(epoch)), weights=counts, minlength=order.nodes
    ).astype(np.int64)


def shuffled_within(group: np.ndarray, g: np.random.Generator) -> np.ndarray:
    """[n] ascending group numbers -> [n] the positions 0..n-1 group after group, in random order
    within each: a random permutation, stably sorted by group (a radix sort while the group numbers
    fit in 16 bits: linear time)."""
    perm = g.permutation(len(group))
    key = group[perm]
    if len(key) and key.max() < 2**16:
        key = key.astype(np.uint16)
    return perm[np.argsort(key, kind="stable")]
