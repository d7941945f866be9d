"""Where and how models run: the default device, a checked device from the user's text, the
dtypes by name, and the CPU settings every stage applies once at start-up.

torch is imported where it is used: the stages' configs import this module, and a mistaken flag
or path is answered before torch is imported (docs/reliability.md)."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from store.errors import ConfigError

if TYPE_CHECKING:
    import torch

AUTO = "cuda if available, else cpu"  # what the default device means, for help texts
THREADS_AUTO = "$OMP_NUM_THREADS, else cores / processes"  # what default_threads gives, for help texts
DTYPE_NAMES = ("bf16", "fp16", "fp32")


def dtype(name: str) -> torch.dtype:
    """The torch dtype of a name of DTYPE_NAMES."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve(device: str | None, flag: str = "--device") -> torch.device:
    """A torch device from the user's text (None: the default), checked to exist here."""
    import torch

    try:
        dev = torch.device(device or default_device())
    except RuntimeError:
        raise ConfigError(flag, device, "not a torch device (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(flag, device, "CUDA is not available on this machine")
    return dev


def prepare_cpu(threads: int | None = None) -> None:
    """Before any parallel region: flush denormals (they make CPU forwards ~100x slower) and set the
    intra-op threads when given."""
    import torch

    torch.set_flush_denormal(True)
    if threads:
        torch.set_num_threads(threads)


def release(device: str) -> None:
    """Give the memory of tensors no longer referenced back to the device (CUDA's cache holds it)."""
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def default_threads(processes: int) -> int:
    """CPU intra-op threads per process when not told: $OMP_NUM_THREADS, else the cores shared out."""
    return int(os.environ.get("OMP_NUM_THREADS", 0)) or max(1, (os.cpu_count() or 1) // processes)


@dataclass(frozen=True)
class Process:
    """This process's place in a launch: torchrun and `accelerate launch` (RANK, WORLD_SIZE,
    LOCAL_RANK), SLURM's srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID), or alone."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls, env=None) -> Process:
        env = os.environ if env is None else env
        for rank, world, local in (
            ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
            ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
        ):
            if rank in env and world in env:
                return cls(int(env[rank]), int(env[world]), int(env.get(local, env[rank])))
        return cls()

    def device(self, device: str) -> str:
        """`cuda` means this process's own GPU, cuda:LOCAL_RANK; any other device stays as given."""
        return f"cuda:{self.local_rank}" if device == "cuda" else device

    def label(self) -> str:
        """'' alone, else 'rank R/W ' to put before each line a process prints."""
        return f"rank {self.rank}/{self.world} " if self.world > 1 else ""
