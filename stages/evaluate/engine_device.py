"""Where the --served engine runs: its own device and its share of that device's memory, chosen
when it starts (after the evaluator has freed what it no longer needs), and named in the report.

A GPU is given as this process numbers them (cuda:N); the engine is started with
CUDA_VISIBLE_DEVICES naming that one GPU of the node, so it sees it as its only device. vLLM refuses
to start when less than its share is free, so the share is checked here first, in one line. On
CPU, vLLM reads the share as one of host memory; it is passed when given, else vLLM's default.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from pipeline.errors import EngineError

CEILING = 0.9  # vLLM's own default share
MARGIN = 0.03  # left free beside the engine (the evaluator's CUDA context, allocator slack)
GIB = 2**30


@dataclass(frozen=True)
class EngineDevice:
    device: str  # "cpu", or "cuda:N" as this process numbers GPUs
    gpu: str | None = None  # the node's GPU as CUDA_VISIBLE_DEVICES names it; None on CPU
    memory_share: float | None = None  # vLLM's gpu_memory_utilization; None: vLLM's default (on CPU)
    free_gib: float | None = None  # free on the device when the engine started
    total_gib: float | None = None

    def env(self) -> dict[str, str]:
        """What the engine's process environment needs to see this device alone."""
        return {} if self.gpu is None else {"CUDA_VISIBLE_DEVICES": self.gpu}

    def text(self) -> str:
        if self.gpu is None:
            return self.device + (f", share {self.memory_share:.2f} of host memory" if self.memory_share else "")
        return (
            f"{self.device} (GPU {self.gpu} of the node), share {self.memory_share:.2f} of {self.total_gib:.1f} "
            f"GiB, {self.free_gib:.1f} GiB free at start"
        )


def node_gpu(index: int, visible: str | None) -> str:
    """This process's cuda:index -> that GPU's name in the node's numbering (CUDA_VISIBLE_DEVICES)."""
    if not visible:
        return str(index)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if index >= len(ids):
        raise EngineError(
            f"--served-device cuda:{index}: CUDA_VISIBLE_DEVICES={visible} shows this process {len(ids)} GPU(s)"
        )
    return ids[index]


def default_share(free: int, total: int) -> float:
    """vLLM's 0.9, or what is free less a margin, rounded down to a hundredth."""
    return math.floor(min(CEILING, free / total - MARGIN) * 100) / 100


def choose(device: str, share: float | None) -> EngineDevice:
    """The engine's device ('cpu' or 'cuda[:N]') and memory share (None: the default above), checked
    against what is free on it now."""
    if not device.startswith("cuda"):  # vLLM's CPU backend reads the share as one of host memory
        return EngineDevice(device, memory_share=share)
    index = torch.device(device).index or 0
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= seen:
        raise EngineError(f"--served-device {device}: this process sees {seen} GPU(s)")
    free, total = torch.cuda.mem_get_info(index)
    picked = default_share(free, total) if share is None else share
    if picked * total > free or picked < 0.05:
        raise EngineError(
            f"--served-device {device}: {free / GIB:.1f} of {total / GIB:.1f} GiB free, the engine "
            f"needs share {picked:.2f} ({picked * total / GIB:.1f} GiB); another process holds the "
            "rest: give --served-device another GPU or a smaller --served-memory"
        )
    return EngineDevice(
        f"cuda:{index}",
        node_gpu(index, os.environ.get("CUDA_VISIBLE_DEVICES")),
        picked,
        round(free / GIB, 1),
        round(total / GIB, 1),
    )
