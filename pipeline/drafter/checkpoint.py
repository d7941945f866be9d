"""Drafter checkpoints in the public DFlash layout: DIR/config.json + DIR/model.safetensors.

Loading is strict: a missing, unexpected or wrongly shaped tensor is an error that names every
one of them, so a drafter whose `fc` silently stayed random cannot happen.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from pipeline.drafter.config import DrafterConfig, TrainingRecord, read_config
from pipeline.errors import DrafterError
from store.io import file_modes

WEIGHTS = "model.safetensors"
MODELING = "modeling_dflash.py"  # our own modeling file, written into every checkpoint (see auto_map)
MODELING_SOURCE = Path(__file__).with_name(MODELING)
AUTO_MAP = {"AutoModel": f"{MODELING.removesuffix('.py')}.DFlashDraftModel"}
SERVING_FILES = ("config.json", WEIGHTS, MODELING)  # what a serving consumer reads


def expected_shapes(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config holds, with its shape (the released names)."""
    c = config
    H, q, kv, d = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.head_dim
    out = {"fc.weight": (H, c.num_taps * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        out.update(
            {
                p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,),
                p + "self_attn.q_proj.weight": (q, H),
                p + "self_attn.k_proj.weight": (kv, H),
                p + "self_attn.v_proj.weight": (kv, H),
                p + "self_attn.o_proj.weight": (H, q),
                p + "self_attn.q_norm.weight": (d,),
                p + "self_attn.k_norm.weight": (d,),
                p + "mlp.gate_proj.weight": (c.intermediate_size, H),
                p + "mlp.up_proj.weight": (c.intermediate_size, H),
                p + "mlp.down_proj.weight": (H, c.intermediate_size),
            }
        )
    if c.head == "dspark":  # vLLM 0.32 Qwen3DSparkModel's names (pipeline/drafter/dspark.py)
        r = c.markov_rank
        out.update(
            {
                "markov_head.markov_w1.weight": (c.vocab_size, r),
                "markov_head.markov_w2.weight": (c.vocab_size, r),
                "confidence_head.proj.weight": (1, H + r),
                "confidence_head.proj.bias": (1,),
            }
        )
    return out


def check_tensors(config: DrafterConfig, tensors: dict[str, torch.Tensor], where: str) -> None:
    want = expected_shapes(config)
    missing = sorted(set(want) - set(tensors))
    unexpected = sorted(set(tensors) - set(want))
    shapes = sorted(
        f"{k} {tuple(tensors[k].shape)} (config needs {want[k]})"
        for k in set(want) & set(tensors)
        if tuple(tensors[k].shape) != want[k]
    )
    problems = [
        f"{label}: {', '.join(items)}"
        for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", shapes))
        if items
    ]
    if problems:
        raise DrafterError(f"{where} does not match its config.json: " + "; ".join(problems))


def write(
    directory: str | Path,
    config: DrafterConfig,
    state: dict[str, torch.Tensor],
    record: TrainingRecord | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """config.json + model.safetensors + modeling_dflash.py into an existing directory. state: the
    drafter's state_dict. config.json's auto_map points `AutoModel.from_pretrained(DIR,
    trust_remote_code=True)` at the modeling file, so that path builds this drafter (without it,
    transformers builds a plain Qwen3Model and drops fc/hidden_norm)."""
    directory = Path(directory)
    check_tensors(config, state, "state to save")
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}
    save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})
    file_modes.as_umask(directory / WEIGHTS)  # safetensors makes it owner-only (0600)
    hf = config.to_hf(record)
    hf["dtype"] = str(dtype).removeprefix("torch.")
    hf["auto_map"] = AUTO_MAP
    shutil.copyfile(MODELING_SOURCE, directory / MODELING)
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def save(
    directory: str | Path,
    config: DrafterConfig,
    state: dict[str, torch.Tensor],
    record: TrainingRecord | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write DIR atomically: into a temporary sibling, then a rename. A write that fails (a full disk)
    leaves no temporary sibling behind."""
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        write(tmp, config, state, record, dtype)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, directory)
    return directory


def publish(tmp: Path, directory: Path) -> None:
    """Replace DIR by the finished TMP (a reader never sees a half-written checkpoint)."""
    if directory.exists():
        old = directory.with_name(f".{directory.name}.old{os.getpid()}")
        os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old)
    else:
        os.replace(tmp, directory)


def _opened(directory: str | Path) -> tuple[DrafterConfig, TrainingRecord | None, Path]:
    """A checkpoint's config, record and weights file, which must exist."""
    config, record = read_config(Path(directory))
    path = Path(directory) / WEIGHTS
    try:
        with open(path, "rb"):  # safetensors calls a file it may not read "No such file"
            pass
    except FileNotFoundError:
        raise DrafterError(f"{path}: no such file (a checkpoint needs config.json and {WEIGHTS})") from None
    except PermissionError:
        raise DrafterError(
            f"{path}: permission denied: {_mode_text(path)}; its owner can make it readable (chmod a+r)"
        ) from None
    return config, record, path


def _mode_text(path: Path) -> str:
    """'mode 0600, owner uid 1000, this process uid 1001', or why the mode cannot be read."""
    try:
        st = path.stat()
    except OSError as e:
        return f"its mode cannot be read ({e.strerror})"
    return f"mode {st.st_mode & 0o7777:04o}, owner uid {st.st_uid}, this process uid {os.geteuid()}"


def load(directory: str | Path) -> tuple[DrafterConfig, dict[str, torch.Tensor], TrainingRecord | None]:
    """(config, tensors, our training record or None) from a checkpoint directory; strict."""
    config, record, path = _opened(directory)
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise DrafterError(f"{path}: unreadable ({e})") from None
    check_tensors(config, tensors, str(path))
    return config, tensors, record


def inspect(directory: str | Path) -> tuple[DrafterConfig, TrainingRecord | None]:
    """(config, our training record or None), with every tensor's name and shape checked against the
    config from the weights file's header alone: as strict as `load`, without reading the weights."""
    config, record, path = _opened(directory)
    try:
        with safe_open(str(path), framework="pt") as f:
            shapes = {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise DrafterError(f"{path}: unreadable ({e})") from None
    check_tensors(config, shapes, str(path))
    return config, record


def load_into(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy tensors into the model's parameters, strictly, keeping the model's dtype."""
    model.load_state_dict({k: v.to(next(model.parameters()).dtype) for k, v in tensors.items()}, strict=True)
