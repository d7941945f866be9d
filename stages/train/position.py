"""Where a run is in its data, independent of how many processes read it.

An epoch's batches form one global list (`epoch_batches` with one rank); a launch of W processes
deals the part of it still to come in W equal contiguous blocks, one per rank, and drops the tail
that does not divide (epoch_order.py). A `Position` is the epoch and the global batches of it still to
come, as [lo, hi) ranges: saved with every step-N, it lets a run resume on any number of
processes, which deal the remaining batches among themselves and go on with the next epochs
dealt the same way. On the number of processes it was saved with, that deal gives every rank
exactly the batches it would have read next.

With --data-order node an epoch's list depends on the nodes it is formed for (node_order.py): a
position mid-epoch records the layout (nodes, processes a node) its epoch was formed with, and a
resumed run forms that epoch with it, the later ones with its own launch's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from stages.train.config import DataConfig
from stages.train.epoch_order import Batches, epoch_length, train_batches
from stages.train.node_order import node_layout
from stages.train.samples import Refs

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Position:
    epoch: int = 0
    remaining: Ranges | None = None  # global batch indices of the epoch still to come; None: all of it
    # --data-order node: (nodes, processes a node) the epoch was formed with; None: the launch's
    layout: tuple[int, int] | None = None
    # --follow, --shard-schedule: each epoch's shards so far, epoch after epoch (stages/train/shard_schedule.py);
    # None: every epoch trains on the shards fixed at launch
    schedule: tuple[str, ...] | None = None

    def to_json(self) -> dict:
        out = {"epoch": self.epoch, "remaining": None if self.remaining is None else [list(r) for r in self.remaining]}
        return (
            out
            | ({} if self.layout is None else {"layout": list(self.layout)})
            | ({} if self.schedule is None else {"schedule": list(self.schedule)})
        )

    @classmethod
    def from_json(cls, d: dict) -> Position:
        layout = tuple(int(n) for n in d["layout"]) if d.get("layout") else None
        return cls(
            d["epoch"],
            None if d["remaining"] is None else tuple((int(a), int(b)) for a, b in d["remaining"]),
            layout,
            None if d.get("schedule") is None else tuple(d["schedule"]),
        )

    def layout_of(self, config: DataConfig, epoch: int, world: int, local: int) -> tuple[int, int]:
        """The (nodes, processes a node) epoch `epoch` is formed with under a launch of `world`
        processes, `local` a node: the recorded one for the position's own epoch, else the launch's."""
        if epoch == self.epoch and self.layout is not None and config.data_order == "node":
            return self.layout
        return node_layout(world, local)


def epochs_done(step: int, grad_accum: int, micro_per_epoch: int) -> float:
    """Epochs a run has made after `step` optimizer steps, to 3 decimals: every rank reads grad_accum
    micro-batches a step and micro_per_epoch an epoch (epoch 0's count: packed epochs differ slightly).
    metrics.jsonl's `epoch` and the checkpoints' training record both give this figure."""
    return round(step * grad_accum / micro_per_epoch, 3)


def epoch_indices(position: Position, epoch: int, n_batches: int) -> np.ndarray:
    """[k] the global batch indices epoch `epoch` still has to give, from `position` on."""
    if epoch > position.epoch or position.remaining is None:
        return np.arange(n_batches)
    return np.concatenate([np.arange(lo, hi) for lo, hi in position.remaining] or [np.zeros(0, np.int64)])


def deal(indices: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Rank's contiguous block of indices; every rank gets the same number (the tail is dropped)."""
    per = len(indices) // world
    return indices[rank * per : (rank + 1) * per]


def rank_batches(
    config: DataConfig, refs: Refs, position: Position, epoch: int, rank: int, world: int, local: int = 1
) -> Batches:
    """This rank's batches of `epoch` (at or after the position's), in order; refs: that epoch's
    samples; local: the launch's processes a node (LOCAL_WORLD_SIZE)."""
    every = train_batches(config, refs, epoch, layout=position.layout_of(config, epoch, world, local))
    return every[deal(epoch_indices(position, epoch, len(every)), rank, world)]


def advance(
    config: DataConfig, refs: Refs | Callable[[int], Refs], position: Position, micro: int, world: int, local: int = 1
) -> Position:
    """The position after each of `world` ranks (`local` a node) read `micro` more micro-batches
    from `position`. refs: the samples of every epoch, or epoch -> that epoch's (a run whose shards
    change between epochs: stages/train/shard_schedule.py)."""
    refs_at = refs if callable(refs) else lambda _epoch: refs
    epoch = position.epoch
    while True:
        layout = position.layout_of(config, epoch, world, local)
        indices = epoch_indices(position, epoch, epoch_length(config, refs_at(epoch), epoch, layout))
        per = len(indices) // world
        if micro < per:
            left = indices[: per * world].reshape(world, per)[:, micro:]  # what each rank has still to read
            return Position(epoch, to_ranges(left.reshape(-1)), layout if config.data_order == "node" else None)
        micro -= per
        epoch += 1
        if micro == 0:
            return Position(epoch, None)


def last_epoch_read(
    config: DataConfig, refs: Refs | Callable[[int], Refs], position: Position, micro: int, world: int, local: int = 1
) -> int:
    """The epoch the last of `micro` more micro-batches a rank read from `position` came from: the
    last epoch a run read from (an epoch its loader formed ahead and never handed out is not one);
    -1 when it read nothing."""
    if micro == 0:
        return position.epoch - (position.remaining is None)
    return advance(config, refs, position, micro - 1, world, local).epoch


def epochs_walked(
    config: DataConfig, refs: Refs | Callable[[int], Refs], position: Position, micro: int, world: int, local: int = 1
) -> float:
    """Epochs a run has made once each rank read `micro` more micro-batches from `position`, to 3
    decimals, the epoch under way counted by the share of its batches read: for runs whose epochs
    differ in size (--follow, --shard-schedule), where epochs_done's count of epoch 0's batches
    would not measure them."""
    at = advance(config, refs, position, micro, world, local)
    if at.remaining is None:
        return float(at.epoch)
    refs_at = refs if callable(refs) else lambda _epoch: refs
    total = epoch_length(config, refs_at(at.epoch), at.epoch, at.layout_of(config, at.epoch, world, local))
    left = sum(hi - lo for lo, hi in at.remaining)
    return round(at.epoch + max(0, total - left) / max(1, total), 3)


def to_ranges(indices: np.ndarray) -> Ranges:
    """Ascending-run ranges [lo, hi) of [k] indices, in their order."""
    if not len(indices):
        return ()
    cut = np.flatnonzero(np.diff(indices) != 1) + 1  # where a run ends and the next begins
    starts, ends = np.concatenate([[0], cut]), np.concatenate([cut, [len(indices)]])
    return tuple(zip(indices[starts].tolist(), (indices[ends - 1] + 1).tolist()))
