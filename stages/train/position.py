"""Where a run is in its data, independent of how many processes read it.

An epoch's batches form one global list (`epoch_batches` with one rank); a launch of W processes
deals the part of it still to come in W equal contiguous blocks, one per rank, and drops the tail
that does not divide (data.py). A `Position` is the epoch and the global batches of it still to
come, as [lo, hi) ranges: saved with every step-N, it lets a run resume on any number of
processes, which deal the remaining batches among themselves and go on with the next epochs
dealt the same way. On the number of processes it was saved with, that deal gives every rank
exactly the batches it would have read next.
"""

from __future__ import annotations

from dataclasses import dataclass

from stages.train.data import Ref, epoch_length, train_batches

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Position:
    epoch: int = 0
    remaining: Ranges | None = None  # global batch indices of the epoch still to come; None: all of it

    def to_json(self) -> dict:
        return {"epoch": self.epoch, "remaining": None if self.remaining is None else [list(r) for r in self.remaining]}

    @classmethod
    def from_json(cls, d: dict) -> Position:
        return cls(d["epoch"], None if d["remaining"] is None else tuple((int(a), int(b)) for a, b in d["remaining"]))


def epochs_done(step: int, grad_accum: int, micro_per_epoch: int) -> float:
    """Epochs a run has made after `step` optimizer steps, to 3 decimals: every rank reads grad_accum
    micro-batches a step and micro_per_epoch an epoch (epoch 0's count: packed epochs differ slightly).
    metrics.jsonl's `epoch` and the checkpoints' training record both give this figure."""
    return round(step * grad_accum / micro_per_epoch, 3)


def epoch_indices(position: Position, epoch: int, n_batches: int) -> list[int]:
    """The global batch indices epoch `epoch` still has to give, from `position` on."""
    if epoch > position.epoch or position.remaining is None:
        return list(range(n_batches))
    return [i for lo, hi in position.remaining for i in range(lo, hi)]


def deal(indices: list[int], rank: int, world: int) -> list[int]:
    """Rank's contiguous block of indices; every rank gets the same number (the tail is dropped)."""
    per = len(indices) // world
    return indices[rank * per:(rank + 1) * per]


def rank_batches(config, refs: list[Ref], position: Position, epoch: int, rank: int, world: int) -> list:
    """This rank's batches of `epoch` (at or after the position's), in order."""
    every = train_batches(config, refs, epoch)
    return [every[i] for i in deal(epoch_indices(position, epoch, len(every)), rank, world)]


def advance(config, refs: list[Ref], position: Position, micro: int, world: int) -> Position:
    """The position after each of `world` ranks read `micro` more micro-batches from `position`."""
    epoch = position.epoch
    while True:
        indices = epoch_indices(position, epoch, epoch_length(config, refs, epoch))
        per = len(indices) // world
        if micro < per:
            left = [i for r in range(world) for i in indices[r * per + micro:(r + 1) * per]]
            return Position(epoch, to_ranges(left))
        micro -= per
        epoch += 1
        if micro == 0:
            return Position(epoch, None)


def to_ranges(indices: list[int]) -> Ranges:
    """Ascending-run ranges [lo, hi) of a list of indices, in its order."""
    out: list[list[int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1][1] += 1
        else:
            out.append([i, i + 1])
    return tuple((a, b) for a, b in out)
