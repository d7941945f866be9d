"""Evaluation's processes under `torchrun` / `accelerate launch`: each replays its own part of the
prompts and rank 0 gathers the per-prompt counts and writes the report. Alone, nothing to join."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pipeline.device import Process


def join(proc: Process, device: str) -> None:
    """Join the launch's process group (NCCL on GPUs, gloo on CPU) when there is more than one process."""
    if proc.world > 1 and not dist.is_initialized():
        if device.startswith("cuda"):
            torch.cuda.set_device(proc.local_rank)  # gather_object sends through this rank's own GPU
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", rank=proc.rank, world_size=proc.world)


def gather(proc: Process, part):
    """Every rank's `part` (any picklable) as a list in rank order on rank 0; None on the others."""
    if proc.world == 1:
        return [part]
    out = [None] * proc.world if proc.rank == 0 else None
    dist.gather_object(part, out, dst=0)
    return out


def barrier(proc: Process) -> None:
    if proc.world > 1:
        dist.barrier()


def leave(proc: Process) -> None:
    if proc.world > 1 and dist.is_initialized():
        dist.destroy_process_group()
