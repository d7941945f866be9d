"""Where consumers will not reproduce a drafter: the attention and embedding warnings, and vLLM's
KV-cache groups (the arithmetic of vllm/v1/core/kv_cache_utils.py, checked against the real engine
in tests/test_engine_served.py)."""

import dataclasses

import pytest

from pipeline.drafter.serving_engines import serving_warnings, vllm_kv_problem
from store.format.schema import TargetRecord
from tests.drafters import config

HYBRID = ["linear_attention"] * 3 + ["full_attention"]


def target(layer_types, kv_heads, head_dim) -> TargetRecord:
    return TargetRecord(
        path="t",
        model_class="c",
        model_type="m",
        fingerprint="f",
        config_sha256="c",
        weights_sha256={},
        tokenizer_sha256="t",
        chat_template_sha256="c",
        layer_types=tuple(layer_types),
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
    )


@pytest.mark.parametrize(
    "layers, kv, head_dim, drafted, refused",
    [
        (HYBRID * 2, 2, 32, (5, 2, 32), False),  # the tiny target, drafter with its layout: one full bucket of 7
        (HYBRID * 2, 2, 32, (5, 1, 32), True),  # the refusal vLLM gave: 5 drafter layers cut into groups of 2
        (HYBRID * 16, 4, 256, (5, 8, 128), False),  # Qwen3.6-27B and its released drafter: group size 5
        (HYBRID * 16, 4, 256, (5, 4, 256), False),  # the same with the target's layout
        (HYBRID * 16, 4, 256, (20, 8, 128), True),  # 20 drafter layers beside 16 full ones: groups of 16
        (["full_attention"] * 36, 8, 128, (5, 4, 128), False),  # dense target: drafter bucket is the smallest
    ],
)
def test_vllm_groups_every_drafting_layer_together_or_refuses(layers, kv, head_dim, drafted, refused):
    n, dkv, dhd = drafted
    c = config(
        num_hidden_layers=n,
        layer_types=("full_attention",) * n,
        num_attention_heads=8,
        num_key_value_heads=dkv,
        head_dim=dhd,
    )
    problem = vllm_kv_problem(c, target(layers, kv, head_dim))
    assert (problem is not None) == refused
    if refused:
        assert f"--num-kv-heads {kv} --head-dim {head_dim}" in problem


def test_a_store_without_the_layout_says_nothing():
    assert vllm_kv_problem(config(), None) is None
    assert vllm_kv_problem(config(), dataclasses.replace(target(HYBRID, 2, 32), layer_types=None)) is None


def test_warnings_name_what_consumers_do_not_reproduce():
    assert serving_warnings(config(), target(HYBRID * 2, 2, 8)) == []
    sliding = config(layer_types=("sliding_attention", "full_attention"), sliding_window=4)
    (line,) = serving_warnings(sliding, None)
    assert "reference DFlash" in line and "window 4" in line
    (line,) = serving_warnings(config(is_causal=True), None)
    assert "is_causal True: layers [0, 1]" in line and "reference DFlash" in line
    (line,) = serving_warnings(config(input_embedding_scale=2.0), None)
    assert "input_embedding_scale 2.0" in line
