"""The gradients' all-reduce between the processes of a launch, as a DDP communication hook: with
--grad-comm bf16 (the default) rounded to bf16 for the sum (half the bytes on the network; summed in
bf16, then back to fp32), or in fp32 (what DDP does without one: each bucket divided by the world
size, then summed). bf16 is the default by the recipe bench on 2 processes (docs/training.md). The
hook also counts the gradient bytes this process puts into each all-reduce, so the metrics log shows
the traffic of a step, measured rather than assumed.

One all-reduce per optimizer step whatever --grad-accum is: Accelerate skips it on the other
micro-batches (DDP's no_sync)."""

from __future__ import annotations

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

BYTES = {"fp32": 4, "bf16": 2}


class GradComm:
    def __init__(self, precision: str) -> None:
        self.precision = precision
        self.bytes = 0  # gradient bytes this process has all-reduced so far

    def all_reduce(self, group, bucket):  # -> Future[Tensor]; DDP refuses an annotation spelt otherwise
        self.bytes += bucket.buffer().numel() * BYTES[self.precision]
        if self.precision == "bf16":
            return default_hooks.bf16_compress_hook(group, bucket)
        return default_hooks.allreduce_hook(group, bucket)


def install(model: torch.nn.Module, precision: str) -> GradComm | None:
    """The hook on a DDP-wrapped model; None for a single process (nothing is all-reduced)."""
    if not isinstance(model, DistributedDataParallel):
        return None
    comm = GradComm(precision)
    model.register_comm_hook(None, comm.all_reduce)
    return comm


def step_bytes(model: torch.nn.Module, precision: str) -> int:
    """What one optimizer step all-reduces: every trainable parameter's gradient, once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad) * BYTES[precision]
