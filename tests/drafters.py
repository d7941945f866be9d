"""Drafters for tests: a tiny config and model, one sequence of states, blocks run the training way,
and checkpoints written the way the released DFlash drafters are published (independently of
pipeline/drafter/checkpoint.py: a hand-written config.json with block_size at the top level,
mask_token_id and target_layer_ids in dflash_config, v4-style rope_theta, no key of ours, and
safetensors whose tensor names are spelled out here)."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipeline.drafter import masks
from pipeline.drafter.blocks import make_blocks
from pipeline.drafter.config import DrafterConfig
from pipeline.drafter.model import Drafter

H, V, TAPS, B = 32, 50, (1, 3), 4


def config(**over) -> DrafterConfig:
    base = dict(
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=V,
        block_size=B,
        mask_token_id=V - 1,
        target_layer_ids=TAPS,
        num_target_layers=6,
        layer_types=("full_attention", "full_attention"),
    )
    return DrafterConfig(**{**base, **over})


def drafter(c: DrafterConfig | None = None, seed: int = 0) -> Drafter:
    g = torch.Generator().manual_seed(seed)
    m = Drafter(c or config(), torch.randn(V, H, generator=g), torch.randn(V, H, generator=g))
    m.init_weights(torch.Generator().manual_seed(seed + 1), std=0.2)
    return m.eval()


def run_blocks(m: Drafter, hidden, tokens, anchors, ctx_len=None, shift=0, kind="local"):
    """Drafter output [N, B, H] for anchors over one sequence (the training computation)."""
    anchors = torch.tensor([anchors])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    blk = make_blocks(tokens[None], torch.ones(1, len(tokens), dtype=torch.bool), anchors, valid, B, V - 1)
    S = ctx_len if ctx_len is not None else int(anchors.max())
    mk = masks.build(m.rules, anchors, valid, S, B, kind)
    pos = torch.arange(S)[None] + shift
    with torch.no_grad():
        return m(hidden[None, :S], blk.block_ids, pos, blk.positions + shift, mk)[0].view(-1, B, H)


def sequence(T=20, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, len(TAPS), H, generator=g).to(torch.bfloat16), torch.randint(0, V - 1, (T,), generator=g)


# The released Qwen3.6-27B drafter's config, as SPEC §2 describes it (v4-style rope_theta, block_size at
# the top level, no is_causal key).
RELEASED_27B = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
    "sliding_window": 2048,
    "rope_theta": 1e7,
    "vocab_size": 248320,
    "block_size": 16,
    "num_target_layers": 64,
    "rms_norm_eps": 1e-6,
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
}


def write_released(
    directory: Path,
    hidden: int,
    vocab: int,
    taps: list[int],
    mask_id: int,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    inter: int = 256,
    seed: int = 0,
) -> dict:
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    tensors = {
        "fc.weight": w(hidden, len(taps) * hidden),
        "hidden_norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
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
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "block_size": 16,
        "layer_types": ["sliding_attention"] * (layers - 1) + ["full_attention"],
        "sliding_window": 64,
        "num_target_layers": 8,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": list(taps)},
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return tensors
