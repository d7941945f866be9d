"""Writes a drafter checkpoint the way the released DFlash drafters are published, independently of
pipeline/checkpoint.py: a hand-written config.json (block_size at the top level, mask_token_id and
target_layer_ids in dflash_config, v4-style rope_theta, no key of ours) and safetensors whose
tensor names are spelled out here."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_released(directory: Path, hidden: int, vocab: int, taps: list[int], mask_id: int, layers: int = 2,
                   heads: int = 4, kv_heads: int = 2, head_dim: int = 32, inter: int = 256, seed: int = 0) -> dict:
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    tensors = {"fc.weight": w(hidden, len(taps) * hidden), "hidden_norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
               "norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(layers):
        p = f"layers.{i}."
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[p + "self_attn.q_proj.weight"] = w(heads * head_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = w(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = w(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = w(hidden, heads * head_dim)
        tensors[p + "self_attn.q_norm.weight"] = torch.ones(head_dim, dtype=torch.bfloat16)
        tensors[p + "self_attn.k_norm.weight"] = torch.ones(head_dim, dtype=torch.bfloat16)
        tensors[p + "mlp.gate_proj.weight"] = w(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = w(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = w(hidden, inter)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False, "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 40960, "block_size": 16,
        "layer_types": ["sliding_attention"] * (layers - 1) + ["full_attention"], "sliding_window": 64,
        "num_target_layers": 8, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": list(taps)},
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return tensors
