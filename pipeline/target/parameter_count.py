"""A target's parameters and weight bytes from its text config alone: no weights, no meta device,
arithmetic over the config's fields (Hugging Face names; a published architecture's or a target
directory's `config.json`, its `text_config` when it has one).

The Qwen3.5/3.6 hybrid family (`qwen3_5_text`, `qwen3_5_moe_text`, and the same field names in
Qwen3-Next): layer i is full attention when `layer_types[i]` says so (else every
`full_attention_interval`-th layer), Gated DeltaNet otherwise. Other decoder-only configs (Llama,
Qwen2/3) are counted as plain attention + MLP layers. tests/pipeline/target/test_parameter_count.py
checks the counts against the tensors transformers builds for each published architecture.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import TargetError


def text_config(config: dict) -> dict:
    """The text tower's fields: a multimodal release nests them under `text_config`."""
    return {**config, **config.get("text_config", {})}


def read_config(directory: str | Path) -> dict:
    """A target directory's text config (its config.json), refused in one line when missing."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise TargetError(f"{directory}: no config.json (expected a model directory)")
    return text_config(json.loads(path.read_text()))


def layer_types(config: dict) -> list[str]:
    """Each decoder layer's kind: 'full_attention' or 'linear_attention'."""
    n = config["num_hidden_layers"]
    if config.get("layer_types"):
        return list(config["layer_types"])[:n]
    every = config.get("full_attention_interval")
    if every is None:
        return ["full_attention"] * n
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def full_attention(config: dict) -> int:
    """q (doubled by the output gate), k, v, o; q/k norms when the family has them; biases if any."""
    h, d = config["hidden_size"], _head_dim(config)
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    gated = config.get("attn_output_gate", config["model_type"].startswith(("qwen3_5", "qwen3_next")))
    gate = 2 if gated else 1  # transformers' default for the hybrid family: gated
    n = h * q * gate + 2 * h * kv + q * h
    if config.get("attention_bias"):
        n += q * gate + 2 * kv
    if config["model_type"].startswith("qwen3"):
        n += 2 * d  # q_norm, k_norm
    return n


def linear_attention(config: dict) -> int:
    """Gated DeltaNet: q, k, v, z, b, a in-projections; the causal conv over q, k, v; dt_bias and
    A_log a value head; the gated norm over a head; the out-projection."""
    h = config["hidden_size"]
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    key, value = nk * config["linear_key_head_dim"], nv * config["linear_value_head_dim"]
    conv = (2 * key + value) * config["linear_conv_kernel_dim"]
    return h * (2 * key + 2 * value + 2 * nv) + conv + 2 * nv + config["linear_value_head_dim"] + value * h


def mlp(config: dict) -> int:
    """A dense gated MLP, or the MoE's router, experts, shared expert and its gate."""
    h = config["hidden_size"]
    if not config.get("num_experts"):
        return 3 * h * config["intermediate_size"]
    experts = config["num_experts"] * 3 * h * config["moe_intermediate_size"]
    shared = config.get("shared_expert_intermediate_size") or 0
    return h * config["num_experts"] + experts + (3 * h * shared + h if shared else 0)


def decoder_layer(config: dict, kind: str) -> int:
    """One layer: its mixer, its MLP, its two norms."""
    mixer = full_attention(config) if kind == "full_attention" else linear_attention(config)
    return mixer + mlp(config) + 2 * config["hidden_size"]


def parameters(config: dict) -> int:
    """Every parameter of the text causal LM: embedding, layers, final norm, lm_head (unless tied)."""
    config = text_config(config)
    h, v = config["hidden_size"], config["vocab_size"]
    head = 0 if config.get("tie_word_embeddings") else v * h
    return v * h + sum(decoder_layer(config, k) for k in layer_types(config)) + h + head


def weight_bytes(config: dict, bytes_per_parameter: int = 2) -> int:
    """The weights' bytes as loaded (bf16 by default)."""
    return parameters(config) * bytes_per_parameter
