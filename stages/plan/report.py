"""A plan as text: what `pipeline plan` prints (decimal GB and TB; every rate with how it is known)."""

from __future__ import annotations

import textwrap

from stages.plan import memory, rates
from stages.plan.run import GB, TB, Plan

WIDTH = 96


def _span(pair: tuple[float, float], unit: float, digits: int = 1) -> str:
    low, high = (x / unit for x in pair)
    return (
        f"{low:,.{digits}f}" if round(low, digits) == round(high, digits) else f"{low:,.{digits}f}-{high:,.{digits}f}"
    )


def render(plan: Plan) -> str:
    c = plan.config
    gpus = c.nodes * c.gpus_per_node
    tokens = c.rows * c.sample_tokens
    ratios = tuple(s / plan.raw for s in plan.stored)
    lines = [
        f"target {plan.name}: {plan.parameters / 1e9:.2f}B parameters, {plan.weights / GB:.1f} GB in bf16 "
        f"(hidden {plan.shape.hidden:,}, vocabulary {plan.shape.vocab:,}, {c.taps} taps"
        f"{' + the final state' if c.final_state else ''})",
        f"drafter: {plan.shape.drafter_parameters / 1e9:.2f}B trainable parameters, {c.drafter_layers} layers, "
        f"head {c.head}{f' (Markov rank {c.markov_rank}, {c.markov_optimizer})' if c.head == 'dspark' else ''}",
        f"data: {c.rows:,} rows x ({c.prompt_tokens:,} + {c.completion_tokens:,}) tokens = {tokens / 1e9:.2f}B tokens",
        f"  in {plan.shards:,} shards of {c.shard_rows:,} rows "
        f"({plan.training_shards:,} training, {c.eval_shards} held out)",
        f"cluster: {c.nodes} nodes x {c.gpus_per_node} GPUs of {c.gpu_memory_gb:g} GB, "
        f"{c.local_disk_tb:g} TB local disk, {c.network_gbps:g} Gb/s a node",
        "",
        "store",
        f"  raw            {plan.raw / TB:,.1f} TB ({c.states} x {plan.shape.hidden:,} x 2 B = "
        f"{c.states * plan.shape.hidden * 2:,} B a token)",
        f"  {c.hidden_format:<14} {_span(plan.stored, TB)} TB ({_span(ratios, 1, 3)}x raw,",
        f"                 {rates.CODED_SOURCE})",
        f"  a node's share {_span(plan.share, TB)} TB of the training shards, cache {plan.cache / TB:.1f} TB "
        f"(--cache-size {plan.cache / TB:.0f}T): fits",
        f"  first epoch    {_span(tuple(s * 8 / (c.network_gbps * 1e9) / 3600 for s in plan.share), 1)} h a node "
        f"to fetch its share at {c.network_gbps:g} Gb/s, then read from the cache",
        "",
        f"memory a GPU ({c.gpu_memory_gb:g} GB; stages/plan/memory.py)",
    ]
    for stage, parts in plan.memory.items():
        detail = ", ".join(f"{k} {v / GB:.1f}" for k, v in parts.items())
        head = f"  {stage:<14} {memory.total(parts) / GB:5.1f} GB: "
        lines += textwrap.wrap(detail, WIDTH, initial_indent=head, subsequent_indent=" " * len(head))
    lines += [
        f"  capture batch  {plan.capture_tokens:,} tokens a forward beside the weights (--capture-tokens at most this)",
        "",
        "rates (a GPU, unless said)",
    ]
    for k, r in plan.rates.items():
        lines += textwrap.wrap(r.text(), WIDTH, initial_indent=f"  {k:<14} ", subsequent_indent=" " * 17)
    lines += ["", f"GPU-hours and wall time on {gpus} GPUs"]
    for stage, hours in plan.hours.items():
        wall = tuple(h / gpus for h in hours)
        lines.append(f"  {stage:<14} {_span(hours, 1, 0)} GPU-h, {_span(wall, 1)} h")
    need = plan.rates["training"].low * c.sample_tokens * c.states * plan.shape.hidden * 2 / 1e6
    workers = need / plan.rates["loader"].low
    lines.append(f"  reads          {need:,.0f} MB/s raw a training GPU: {workers:.2f} of a loader worker")
    return "\n".join(lines)
