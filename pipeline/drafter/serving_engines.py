"""The programs that serve a drafter, and where they will not reproduce it as it was trained.

Training, replay and our own modeling file (modeling_dflash.py) apply one attention rule per
layer (`DrafterConfig.layer_rule`): full layers bidirectional inside the block, sliding layers
causal and windowed, `is_causal` overriding both. The consumers below were read from their code;
docs/training.md has the same table. `serving_warnings` names, for one drafter, every consumer
that will compute something else, and whether vLLM can cache its layers beside the target's.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from pipeline.drafter.config import DrafterConfig
from store.format.schema import TargetRecord


@dataclass(frozen=True)
class Consumer:
    name: str
    sliding: str  # what it does with a sliding_attention layer
    same_rule: bool  # applies our rule to every layer, sliding ones included
    applies_embedding_scale: bool = False  # none does: input_embedding_scale != 1 is ours alone


CONSUMERS = (
    Consumer(
        "vLLM 0.32 (qwen3_dflash.py)", "causal and windowed; mixed sliding/full needs VLLM_USE_V2_MODEL_RUNNER=1", True
    ),
    Consumer("SGLang (DFLASH)", "causal and windowed", True),
    Consumer("SpecForge (training masks)", "causal inside the block, windowed", True),
    Consumer(
        "reference DFlash (Transformers)",
        "bidirectional (is_causal False on every layer); the window is ignored under SDPA",
        False,
    ),
)


def serving_warnings(config: DrafterConfig, target: TargetRecord | None) -> list[str]:
    """One line per way a consumer will not compute this drafter's training-time attention, or
    will not load it; [] when every consumer agrees."""
    out = []
    rules = [config.layer_rule(i) for i in range(config.num_hidden_layers)]
    odd = [i for i, rule in enumerate(rules) if rule != (False, None)]  # causal or windowed
    if odd:
        others = [c.name for c in CONSUMERS if not c.same_rule]
        what = (
            f"sliding_attention layers (window {config.sliding_window})"
            if "sliding_attention" in config.layer_types
            else f"is_causal {config.is_causal}"
        )
        out.append(
            f"{what}: layers {odd} were trained causal or windowed; {', '.join(others)} will not reproduce "
            "that (bidirectional everywhere, window ignored under SDPA); vLLM, SGLang and this project's "
            "modeling_dflash.py do"
        )
    if config.input_embedding_scale != 1.0:
        out.append(
            f"input_embedding_scale {config.input_embedding_scale}: no serving consumer applies it, so "
            "every one will draft from differently scaled embeddings"
        )
    if config.head == "dspark":
        out.append(
            "dspark head: only vLLM (0.32 or later, method dspark, its V2 model runner) drafts with the Markov "
            "transition head; SGLang and modeling_dflash.py do not load this Qwen3DSparkModel checkpoint as it is"
        )
    problem = vllm_kv_problem(config, target)
    if problem:
        out.append(problem)
    return out


def kv_layout(target: TargetRecord | None) -> tuple[int, int] | None:
    """(KV heads, head_dim) of the target's full-attention layers, when the store recorded them."""
    if target is None or target.num_key_value_heads is None or target.head_dim is None:
        return None
    return target.num_key_value_heads, target.head_dim


def vllm_kv_problem(config: DrafterConfig, target: TargetRecord | None) -> str | None:
    """Why vLLM will refuse this drafter beside this target ("All drafting layers should belong to
    the same kv cache group"), or None.

    vLLM (0.32, v1/core/kv_cache_utils.py) buckets the attention layers of target and drafter by
    cache layout (a drafter layer joins the target's full-attention bucket only with the same KV
    heads and head_dim), takes as group size the smallest bucket's layer count (the largest one's
    when that is under 1.5x the smallest), and cuts every bucket into groups of that size: the
    drafter's layers must all fall in one group. A store without the target's layer types says
    nothing here (None)."""
    layout = kv_layout(target)
    if layout is None or not target.layer_types:
        return None
    kinds = Counter(target.layer_types)  # e.g. {"linear_attention": 48, "full_attention": 16}
    drafted = config.num_hidden_layers
    same = (config.num_key_value_heads, config.head_dim) == layout and "full_attention" in kinds
    buckets = dict(kinds)
    if same:
        buckets["full_attention"] += drafted
    else:
        buckets["drafter"] = drafted
    small, large = min(buckets.values()), max(buckets.values())
    size = large if large < 1.5 * small else small
    mine = buckets["full_attention" if same else "drafter"]
    if math.ceil(mine / size) == 1:
        return None
    return (
        f"vLLM will refuse this drafter beside its target: its {drafted} layers ({config.num_key_value_heads} KV "
        f"heads x head_dim {config.head_dim}) would be split over {math.ceil(mine / size)} KV-cache groups. Give "
        f"it the target's full-attention KV layout (--num-kv-heads {layout[0]} --head-dim {layout[1]})"
    )
