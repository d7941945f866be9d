"""The training recipe's named choices and gamma, what TrainConfig checks, and the line an
interrupted run ends with: free of torch, so that train.py answers a mistaken flag before torch is
imported (docs/reliability.md). The modules that carry them out import them from here:
epoch_order.py (--batching), optim.py (--optimizer, --schedule), step.py (--noise, the slot
weights' gamma)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.drafter.config import default_gamma

if TYPE_CHECKING:
    from stages.train.config import LossConfig

BATCHINGS = ("bucketed", "random", "packed")
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "linear")
NOISES = ("gaussian", "uniform")
INTERRUPTED = "interrupted; rerun with --resume to continue from the last step-N"
NOTHING_SAVED = (
    "interrupted before the first checkpoint (step-N) was saved: nothing to resume; rerun the same "
    "command to start again"
)


def slot_gamma(config: LossConfig, block_size: int) -> float | None:
    """The decay of --slot-weights exp for a drafter of this block size: --gamma, else the block size's
    default (a ConfigError naming --block-size when it has none); None with D-PACE. The one place it
    is resolved: TrainConfig checks it with --block-size, the loss plan takes it with the drafter's
    (with --init-from, the checkpoint's)."""
    if config.slot_weights != "exp":
        return None
    return config.gamma if config.gamma is not None else default_gamma(block_size)
