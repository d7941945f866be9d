"""The target's checkpoint tensors against the text-only model that loads them: strictly.

Transformers initialises a tensor the checkpoint lacks at random (and, told to tolerate a shape
mismatch, one of the wrong shape too) and carries on: extraction would then write a store of
garbage with a valid fingerprint. Here a missing, misshaped or unknown tensor is an error naming
each one. Checkpoint tensors the text model does not use are accepted only when the model class
declares them as known non-text parts (Qwen3.5/3.6: the vision tower `model.visual.*` and the MTP
heads `mtp.*`, transformers' `_keys_to_ignore_on_load_unexpected`); they are counted for the
store's provenance.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from pipeline.errors import TargetError

SUFFIXES = (".safetensors", ".bin")
SHOWN = 8  # names listed per kind of problem; the rest are counted


def files(path: Path) -> list[Path]:
    """The checkpoint's weight files, sorted."""
    found = sorted(p for p in path.iterdir() if p.name.endswith(SUFFIXES))
    if not found:
        raise TargetError(f"--target {path}: no *.safetensors or *.bin weight files")
    return found


def check_loaded(path: Path, model: torch.nn.Module, info: dict) -> None:
    """Refuse a load that left any tensor of the model random or took a tensor it cannot place.
    info: transformers' loading info (`output_loading_info=True`, mismatched sizes tolerated so
    that they are reported here rather than raised one by one)."""
    mismatched = [
        f"{name} (checkpoint {tuple(ckpt)}, model {tuple(want)})"
        for name, ckpt, want in sorted(info.get("mismatched_keys") or [])
    ]
    problems = [
        (f"missing (would be left random): {_names(sorted(info.get('missing_keys') or []))}"),
        (f"wrong shape (would be left random): {_names(mismatched)}"),
        (
            f"not used by {type(model).__name__} and not a known non-text part: "
            f"{_names(sorted(info.get('unexpected_keys') or []))}"
        ),
        (f"load errors: {_names(info.get('error_msgs') or [])}"),
    ]
    problems = [p for p in problems if not p.endswith(": ")]
    if problems:
        raise TargetError(
            f"--target {path}: the checkpoint does not match {type(model).__name__}: " + "; ".join(problems)
        )


def non_text_tensors(path: Path, model: torch.nn.Module) -> dict[str, int]:
    """{pattern: tensors} for the checkpoint tensors the model class knowingly leaves unused."""
    patterns = list(getattr(type(model), "_keys_to_ignore_on_load_unexpected", None) or [])
    counts = dict.fromkeys(patterns, 0)
    for name in tensor_names(path):
        for pattern in patterns:
            if re.search(pattern, name):
                counts[pattern] += 1
                break
    return {p: n for p, n in counts.items() if n}


def tensor_names(path: Path) -> list[str]:
    """Every tensor name in the checkpoint's files, read from their headers (no weights loaded)."""
    from safetensors import safe_open

    names = []
    for f in files(path):
        if f.suffix == ".safetensors":
            with safe_open(str(f), "pt") as fh:
                names += list(fh.keys())
        else:
            names += list(torch.load(f, map_location="meta", weights_only=True, mmap=True))
    return names


def read_tensor(path: Path, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """One tensor of the text model, `name` as the model calls it, read from the checkpoint alone (a
    release's multimodal spelling `model.language_model.*` too), its shape checked."""
    from safetensors import safe_open

    spellings = (name, name.replace("model.", "model.language_model.", 1))
    for f in files(path):
        if f.suffix == ".safetensors":
            with safe_open(str(f), "pt") as fh:
                found = [n for n in spellings if n in fh.keys()]
                tensor = fh.get_tensor(found[0]) if found else None
        else:
            state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            tensor = next((state[n] for n in spellings if n in state), None)
        if tensor is not None:
            if tuple(tensor.shape) != tuple(shape):
                raise TargetError(f"--target {path}: {name} has shape {tuple(tensor.shape)}, the model's is {shape}")
            return tensor
    raise TargetError(f"--target {path}: the checkpoint has no {name}")


def _names(items: list[str]) -> str:
    shown = ", ".join(items[:SHOWN])
    return shown + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "") if items else ""
