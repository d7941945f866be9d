"""A tiny Qwen3.5-MoE hybrid target, made by the test that needs it (no MoE weights are shipped).

The published MoE architecture (pipeline/target/architectures.py's qwen3.5-35b-a3b: Gated DeltaNet
and full-attention layers, routed experts and a shared expert, `Qwen3_5MoeForCausalLM`) at the shipped
tiny target's widths, depth, RoPE and vocabulary (its config.json, read here), with EXPERTS experts of
MOE_WIDTH, ROUTED routed a token, and one shared expert of MOE_WIDTH.

Built by tools/make_target.py's `build`, not by code of its own: the same seeded per-tensor weights,
transformers' save-time renaming (`revert_weight_conversion`: one tensor an expert, as a release
holds them), the same init rules, and the tiny target's tokenizer (its 4,096 tokens are the whole
vocabulary, so no token is generated). A test rather than a `make_target` option because these sizes
are no published architecture: make_target builds releases' shapes, this is a test's fixture.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from pipeline import TINY_TARGET
from pipeline.target.architectures import ARCHS

REPO = Path(__file__).resolve().parents[1]
EXPERTS, ROUTED, MOE_WIDTH = 8, 2, 96  # 2 of 8 routed + the shared one: 288 active, the dense 384 about
WIDTHS = (  # the tiny target's fields the MoE takes as they are
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "max_position_embeddings",
    "rope_parameters",
)


def make_target_module():
    """tools/make_target.py, imported (tools/ is no package)."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import make_target
    finally:
        sys.path.pop(0)
    return make_target


def tiny_moe_arch():
    """The published MoE's config at the tiny target's sizes (module docstring)."""
    moe, tiny = ARCHS["qwen3.5-35b-a3b"], json.loads((TINY_TARGET / "config.json").read_text())
    sizes = {k: tiny[k] for k in WIDTHS}
    experts = {
        "num_experts": EXPERTS,
        "num_experts_per_tok": ROUTED,
        "moe_intermediate_size": MOE_WIDTH,
        "shared_expert_intermediate_size": MOE_WIDTH,
    }
    return dataclasses.replace(moe, name="tiny-moe", config={**moe.config, **sizes, **experts})


def build_tiny_moe(out: Path, seed: int = 0) -> Path:
    """The tiny MoE target written to `out` (seconds): config, bf16 weights, tokenizer, provenance.json."""
    arch = tiny_moe_arch()
    make_target_module().build(arch, out, layers=arch.full_layers, seed=seed, device="cpu", log=lambda m: None)
    return out
