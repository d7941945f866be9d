"""Where the epoch order is formed: each epoch's shuffle of the sample refs, made into rows and
batches and dealt to ranks.

`epoch_batches` orders the refs (samples.py) for one epoch, shuffled by sample with a (seed, epoch)
generator (--data-order node: each node's shards' samples, shuffled within windows of shards,
node_order.py), and forms batches (recipe.BATCHINGS): rows of one sample bucketed by length so
padding stays small, rows of one sample in random order, or packed rows that hold several whole
samples each (packing.py); then deals them to ranks so each rank reads only its own part; an
epoch's batches are `Batches`, arrays like the refs. They are formed with numpy, no Python object a
sample (a batch becomes a list of rows, a row a tuple of `Ref`, only when it is read), by every rank
alike: at 2.5M samples a rank forms an epoch in well under a second and holds at most 12 bytes a
sample of its batches (docs/performance.md). Every rank forms its refs and epochs rather than
receiving them from the main process: that costs about what pickling and sending 30-60 MB to every
rank would, and needs no exchange (every rank waiting on the main process) at each epoch's start;
the (seed, epoch) generator makes them the same everywhere. `train_batches` and `epoch_length` are
the run's epochs under its flags; position.py deals what is left of an epoch to a launch's ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from stages.train.config import DataConfig
from stages.train.node_order import NodeOrder, node_counts, node_samples, shuffled_within
from stages.train.packing import packed_rows
from stages.train.samples import Ref, Refs

BUCKET = 64  # batches of similar length are formed within windows of this many batches

Row = tuple[Ref, ...]  # the samples of one row, in row order


@dataclass(frozen=True, eq=False)
class Batches:
    """A list of batches as arrays, read like a list: batches[i] is the i-th batch as a list of Row,
    batches[slice or index array] those batches (the same rows: nothing copied but `order`).
    Batch i holds rows k*batch_size .. k*batch_size+batch_size-1 (those that exist), k = order[i];
    row r the refs at samples[row_starts[r]:row_starts[r + 1]]."""

    refs: Refs
    samples: np.ndarray  # [S] int32 positions in refs, row after row (the epoch's order)
    row_starts: np.ndarray  # [R + 1] int32 where each row begins in samples
    batch_size: int  # rows a batch (the last batch of the rows may hold fewer)
    order: np.ndarray  # [B] int32 the batches, as numbers of batch_size-row blocks

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i):
        if not isinstance(i, (int, np.integer)):
            return dataclasses.replace(self, order=self.order[i])
        lo = int(self.order[i]) * self.batch_size
        bounds = self.row_starts[lo : lo + self.batch_size + 1].tolist()  # the rows' edges in samples
        refs = list(self.refs[self.samples[bounds[0] : bounds[-1]]])
        return [tuple(refs[a - bounds[0] : b - bounds[0]]) for a, b in zip(bounds, bounds[1:])]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __eq__(self, other) -> bool:  # as lists of batches
        return isinstance(other, (Batches, list)) and list(self) == list(other)

    __hash__ = None


def epoch_batches(
    refs: Refs,
    batch_size: int,
    seed: int,
    epoch: int,
    rank: int = 0,
    world: int = 1,
    batching: str = "bucketed",
    row_tokens: int | None = None,
    order: NodeOrder | None = None,
) -> Batches:
    """This rank's batches of `batch_size` rows for one epoch; every rank gets the same number (the
    tail is dropped). bucketed: one sample a row, rows of similar length batched together (within
    windows of BUCKET batches, a stable sort by length), the batches shuffled; random: one sample a
    row, in the shuffled order; packed: each row takes the next samples of the shuffled order while
    they fit in row_tokens tokens (a sample is never split: Ref.length <= row_tokens). order: the
    node-affine order's layout (node_order.py), None: one global shuffle."""
    key = (batch_size, seed, epoch, batching, row_tokens if batching == "packed" else None, order)
    if key not in refs._last:
        refs._last.clear()
        refs._last[key] = every = _every_batch(refs, *key[:5]) if order is None else _node_batches(refs, *key)
        refs._counts[key] = len(every)
    every = refs._last[key]
    per_rank = len(every) // world
    return every[rank * per_rank : (rank + 1) * per_rank]


def _every_batch(refs: Refs, batch_size: int, seed: int, epoch: int, batching: str, row_tokens: int | None) -> Batches:
    """The epoch's batches before they are dealt (epoch_batches)."""
    g = np.random.default_rng([seed, epoch])
    order = g.permutation(len(refs))  # [N]
    if batching == "bucketed":
        order = _bucket_sorted(order, refs.length, batch_size)
    rows = _rows(refs, order, batching, row_tokens)
    n = -(-(len(rows) - 1) // batch_size)
    batch_order = g.permutation(n) if batching == "bucketed" else np.arange(n, dtype=np.int32)
    return Batches(
        refs,
        order.astype(np.int32),
        rows.astype(np.int32, copy=False),
        batch_size,
        batch_order.astype(np.int32, copy=False),
    )


def _node_batches(
    refs: Refs, batch_size: int, seed: int, epoch: int, batching: str, row_tokens: int | None, order: NodeOrder
) -> Batches:
    """The epoch's batches in the node-affine order: each node's samples in its order
    (node_samples), made into rows and full batches as the global order makes them, but bucketed
    batches are shuffled only within their bucket (BUCKET batches), so that a rank's consecutive
    batches stay within a few windows of shards; every node's section trimmed to the same number of
    batches, a multiple of its processes; the sections node after node, so that the contiguous deal
    to the launch's ranks gives node n's ranks node n's section."""
    sections = []
    for mine in node_samples(refs.shard, seed, epoch, order):
        if batching == "bucketed":
            mine = _bucket_sorted(mine, refs.length, batch_size)
        sections.append((mine, _rows(refs, mine, batching, row_tokens)))
    per = min((len(rows) - 1) // batch_size for _, rows in sections) // order.local * order.local
    samples, row_starts, batch_order, at = [], [np.zeros(1, np.int64)], [], 0
    for n, (mine, rows) in enumerate(sections):
        rows = rows[: per * batch_size + 1]  # [per * batch_size + 1]
        samples.append(mine[: rows[-1]])
        row_starts.append(rows[1:] + at)
        at += int(rows[-1])
        in_order = np.arange(per, dtype=np.int64)
        if batching == "bucketed":  # batches shuffled within their bucket
            in_order = shuffled_within(in_order // BUCKET, np.random.default_rng([seed, 4, epoch, n]))
        batch_order.append(n * per + in_order)
    return Batches(
        refs,
        np.concatenate(samples).astype(np.int32),
        np.concatenate(row_starts).astype(np.int32),
        batch_size,
        np.concatenate(batch_order).astype(np.int32),
    )


def _bucket_sorted(order: np.ndarray, length: np.ndarray, batch_size: int) -> np.ndarray:
    """order sorted by (window of batch_size * BUCKET samples, length), stably: one int64 key."""
    window = np.arange(len(order), dtype=np.int64) // (batch_size * BUCKET)
    return order[np.argsort((window << 32) | length[order], kind="stable")]


def _rows(refs: Refs, order: np.ndarray, batching: str, row_tokens: int | None) -> np.ndarray:
    """[R + 1] where each row begins in `order`: a row a sample, or packed rows."""
    if batching != "packed":
        return np.arange(len(order) + 1, dtype=np.int32)
    return packed_rows(refs.length[order], row_tokens)


def node_order(config: DataConfig, layout: tuple[int, int]) -> NodeOrder | None:
    """The run's node-affine order for a launch of layout (nodes, processes a node); None: the global order."""
    if config.data_order != "node":
        return None
    return NodeOrder(nodes=layout[0], local=layout[1], window=config.shuffle_window, redeal_every=config.redeal_every)


def train_batches(
    config: DataConfig, refs: Refs, epoch: int, rank: int = 0, world: int = 1, layout: tuple[int, int] = (1, 1)
) -> Batches:
    """This rank's batches of one epoch under the run's --batching (packed rows hold --max-length
    tokens) and --data-order, its nodes and processes a node given by layout (node_order.node_layout)."""
    return epoch_batches(
        refs,
        config.batch_size,
        config.seed,
        epoch,
        rank,
        world,
        config.batching,
        config.max_length,
        node_order(config, layout),
    )


def epoch_length(config: DataConfig, refs: Refs, epoch: int, layout: tuple[int, int] = (1, 1)) -> int:
    """The number of batches of `epoch` in all (train_batches with one rank), without forming them
    unless rows are packed (their count depends on the epoch's order): one row a sample otherwise,
    in the node order the nodes' sample counts (the deal alone)."""
    order = node_order(config, layout)
    if config.batching == "packed":
        key = (config.batch_size, config.seed, epoch, "packed", config.max_length, order)
        return refs._counts[key] if key in refs._counts else len(train_batches(config, refs, epoch, layout=layout))
    if order is not None:  # every node's full batches, as many as the smallest node's, a multiple of its processes
        per = int(node_counts(refs.shard, config.seed, epoch, order).min()) // config.batch_size
        return order.nodes * (per // order.local * order.local)
    return -(-len(refs) // config.batch_size)
