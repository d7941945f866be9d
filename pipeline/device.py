"""Where and how models run: the default device, a checked device from the user's text, the
dtypes by name, and the CPU settings every stage applies once at start-up."""

from __future__ import annotations

import torch

from store.errors import ConfigError

AUTO = "cuda if available, else cpu"  # what the default device means, for help texts
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve(device: str | None, flag: str = "--device") -> torch.device:
    """A torch device from the user's text (None: the default), checked to exist here."""
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
    torch.set_flush_denormal(True)
    if threads:
        torch.set_num_threads(threads)
