"""Loading the target: the text-only causal LM and its tokenizer, kernels chosen BEFORE the model
code is imported, and the target's identity (class, sizes, hashes of config, weights, tensor set,
tokenizer) that the store records."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeline import device as devices
from pipeline import fingerprint
from pipeline.errors import TargetError
from pipeline.target import weights
from pipeline.target.kernels import KernelRecorder, select_linear_attention
from pipeline.target.model import Target
from store.errors import ConfigError
from store.format.schema import TargetRecord


def resolve(target: str) -> Path:
    """A local directory for a target path or hub id (the hub cache must already hold it offline)."""
    path = Path(target).expanduser()
    if path.is_dir():
        return path
    if path.exists() or target.startswith((".", "/", "~")):
        raise TargetError(f"--target {target}: not a model directory")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(target))
    except Exception as e:  # network, auth, unknown id: one line for the user
        raise TargetError(
            f"--target {target}: cannot resolve it as a directory or hub id ({type(e).__name__}: {e})".splitlines()[0]
        ) from None


def load(target: str, device: str | None, dtype: str, linear_attention: str, *, with_weights: bool = True) -> Target:
    """Load the text-only causal LM and its tokenizer; pick the kernels BEFORE the model code loads.

    with_weights False: the model is built on the meta device instead (no memory, no weights read,
    no forward possible) but for the embedding and lm_head, read on the host: its tokenizer, sizes,
    generation config, those two tensors and the identity record, as a full load makes them, for a
    run whose forwards happen elsewhere (--capture vllm)."""
    if dtype not in devices.DTYPE_NAMES:
        raise ConfigError("--dtype", dtype, f"expected one of {sorted(devices.DTYPE_NAMES)}")
    dev = devices.resolve(device)
    if dev.type == "cpu":
        devices.prepare_cpu()
    requested = select_linear_attention(dev.type, linear_attention)
    path = resolve(target)
    if not (path / "config.json").is_file():
        raise TargetError(f"--target {path}: no config.json, so not a Hugging Face model directory")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its "falling back to torch" notice is replaced by what the store records
    hf_logging.disable_progress_bar()
    if not with_weights:
        return _without_weights(path, dtype, requested)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model, info = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=devices.dtype(dtype),
            output_loading_info=True,
            ignore_mismatched_sizes=True,
            device_map={"": dev},
        )
    except Exception as e:
        raise TargetError(
            f"--target {path}: cannot load it ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    weights.check_loaded(path, model, info)  # each tensor was read straight onto dev, never the whole model on the host
    model.eval()
    return Target(
        model,
        tokenizer,
        path,
        dev,
        devices.dtype(dtype),
        KernelRecorder(model),
        requested,
        describe(model, tokenizer, path),
    )


def _without_weights(path: Path, dtype: str, requested: str) -> Target:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=devices.dtype(dtype))
        if (path / "generation_config.json").is_file():  # its EOS ids, as from_pretrained reads them
            model.generation_config = GenerationConfig.from_pretrained(path)
    except Exception as e:
        raise TargetError(
            f"--target {path}: cannot read it ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    model.eval()
    record = describe(model, tokenizer, path)
    _read_embeddings(model, path)
    meta = torch.device("meta")  # where its forwards run: none here
    return Target(model, tokenizer, path, meta, devices.dtype(dtype), KernelRecorder(model), requested, record)


def _read_embeddings(model: torch.nn.Module, path: Path) -> None:
    """The embedding and lm_head (the store keeps both) read from the checkpoint onto the host; the
    rest of the model stays on the meta device. A tied lm_head is the embedding, read once."""
    names = {id(p): n for n, p in model.named_parameters()}  # a tied weight under its first name
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        w = module.weight
        if w.is_meta:
            tensor = weights.read_tensor(path, names[id(w)], tuple(w.shape)).to(w.dtype)
            module.weight = torch.nn.Parameter(tensor, requires_grad=False)
    if model.config.get_text_config().tie_word_embeddings:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight


def describe(model: torch.nn.Module, tok, path: Path) -> TargetRecord:
    """Identity of the target: class, hashes of config, weights, tensor set, tokenizer, and the
    checkpoint tensors it knowingly leaves unused."""
    config = model.config.to_dict()
    for volatile in ("transformers_version", "_name_or_path", "dtype", "torch_dtype"):
        config.pop(volatile, None)
    files = {p.name: fingerprint.sha256_file(p) for p in weights.files(path)}
    tensor_set = {k: list(v.shape) for k, v in model.state_dict().items()}
    model_class = f"{type(model).__module__}.{type(model).__qualname__}"
    tok_json = (
        tok.backend_tokenizer.to_str()
        if hasattr(tok, "backend_tokenizer")
        else json.dumps(tok.get_vocab(), sort_keys=True)
    )
    return TargetRecord(
        path=str(path),
        model_class=model_class,
        model_type=model.config.model_type,
        fingerprint=fingerprint.sha256_json(
            {"config": config, "weights": files, "class": model_class, "tensors": tensor_set}
        ),
        config_sha256=fingerprint.sha256_json(config),
        weights_sha256=files,
        tokenizer_sha256=fingerprint.sha256_json({"tokenizer": tok_json, "special": tok.special_tokens_map}),
        chat_template_sha256=fingerprint.sha256_text(tok.chat_template or ""),
        tokenizer_class=type(tok).__name__,
        non_text_tensors=weights.non_text_tensors(path, model),
        **layout(model.config.get_text_config()),
    )


def layout(text) -> dict:
    """The target's context length, layer kinds and full-attention KV layout (drafter serving needs them)."""
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    return {
        "max_position_embeddings": getattr(text, "max_position_embeddings", None),
        "layer_types": tuple(kinds),
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
    }
