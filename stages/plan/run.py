"""`pipeline plan`: from a target, a dataset's size, the store format and a cluster, the store's size,
the node cache, the capture batch, each stage's peak memory and its GPU-hours and wall time; a plan
that would not fit is refused in one line (PlanError)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from pipeline.drafter.checkpoint import expected_shapes
from pipeline.drafter.config import MARKOV_RANK, DrafterConfig, default_sizes
from pipeline.errors import PlanError
from pipeline.target.architectures import ARCHS
from pipeline.target.parameter_count import parameters, read_config
from stages.plan import memory, rates
from stages.plan.config import PlanConfig
from stages.plan.rates import Rate

GB, TB = 10**9, 10**12
EVAL_PROMPTS = 32  # evaluate.py --batch-prompts' default


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Every figure `pipeline plan` prints (report.render), in bytes, tokens, rates and hours."""

    config: PlanConfig
    name: str
    parameters: int
    weights: int
    shape: memory.Shape
    shards: int
    training_shards: int
    raw: int
    stored: tuple[float, float]
    share: tuple[float, float]
    cache: float
    capture_tokens: int
    memory: dict[str, dict[str, int]]
    rates: dict[str, Rate]
    hours: dict[str, tuple[float, float]]


def target_config(target: str) -> tuple[str, dict]:
    """A published architecture's text config by name, else a directory's config.json."""
    if target in ARCHS:
        arch = ARCHS[target]
        return target, arch.text_config(arch.full_layers)
    if not Path(target).is_dir():
        raise PlanError(f"--target {target}: neither a directory nor an architecture ({', '.join(sorted(ARCHS))})")
    return Path(target).name, read_config(target)


def drafter_config(
    hidden: int, vocab: int, taps: int, layers: int, block: int, head: str = "dflash", rank: int = MARKOV_RANK
) -> DrafterConfig:
    """The drafter train.py makes for a store of this width without --drafter-config
    (stages/train/setup.fresh_config: default_sizes), at `layers` layers, with `head` (rank: dspark's r)."""
    sizes = {**default_sizes(hidden), "num_hidden_layers": layers, "head": head, "markov_rank": rank}
    return DrafterConfig(
        hidden_size=hidden,
        vocab_size=vocab,
        block_size=block,
        mask_token_id=vocab - 1,
        target_layer_ids=tuple(range(taps)),
        num_target_layers=None,
        layer_types=("full_attention",) * layers,
        **sizes,
    )


def drafter_parameters(config: DrafterConfig) -> int:
    """The drafter's trainable parameters: every tensor its checkpoint holds (fc, the layers, the norms)."""
    return sum(math.prod(shape) for shape in expected_shapes(config).values())


def training_flops(config: PlanConfig, shape: memory.Shape) -> float:
    """FLOPs to train on one sample (forward x 3: the backward twice the forward, the loss's chunks
    recomputed): the layers over anchors x block rows, lm_head over the labels, fc and the context K/V
    over the sample's tokens, attention of each block row over half the context on average; with
    --final-state the soft targets' logits too; a dspark head's bias over the labels (r values a row)."""
    rows, context = config.anchors * config.block_size, config.sample_tokens
    r = shape.markov_rank  # a dspark head: its table is looked up, its bias [rows, V] made from r values a row
    markov = 2 * shape.vocab * r + (shape.hidden + r + 1 if r else 0)  # Markov matrices, confidence head
    layers = shape.drafter_parameters - config.taps * shape.hidden**2 - markov
    forward = 2 * layers * rows + 2 * (shape.hidden + r) * shape.vocab * config.anchors * (config.block_size - 1)
    forward += 2 * config.taps * shape.hidden**2 * context
    forward += shape.drafter_layers * context * 2 * (2 * shape.hidden * shape.drafter_kv)
    forward += shape.drafter_layers * 4 * rows * (context // 2) * shape.drafter_q
    if not config.final_state:
        return 3 * forward
    # --soft-targets: the drafter's logits come from the same chunks as its CE; the target's, lm_head over
    # the final states before the labels, are made twice (forward, recomputed; no gradient): soft_targets.py
    head = 2 * shape.hidden * shape.vocab * config.anchors * (config.block_size - 1)
    return 3 * forward + 2 * head


def stage_rates(config: PlanConfig, params: int, shape: memory.Shape) -> dict[str, Rate]:
    """The rate of each stage a GPU (and of the writer and a loader worker a process)."""
    flop_token = 2 * params
    assumed = f"{config.tflops:.0f} TFLOP/s assumed / (2 x {params / 1e9:.2f}B FLOP a token)"
    capture = config.tflops * 1e12 / flop_token
    prefill = config.peak_tflops * 1e12 / 2 / flop_token
    train = config.tflops * 1e12 / training_flops(config, shape)
    fmt = config.hidden_format
    return {
        "prefill": Rate(
            low=prefill,
            high=prefill,
            unit="tokens/s",
            kind="arithmetic",
            source=f"50% of {config.peak_tflops:.0f} TFLOP/s",
        ),
        "decode": Rate(
            low=config.decode_tokens_s[0],
            high=config.decode_tokens_s[1],
            unit="tokens/s",
            kind="arithmetic",
            source="assumed",
        ),
        "capture": Rate(low=capture, high=capture, unit="tokens/s", kind="arithmetic", source=assumed),
        "training": Rate(
            low=train,
            high=train,
            unit="samples/s",
            kind="arithmetic",
            source=f"{config.tflops:.0f} TFLOP/s assumed / {training_flops(config, shape):.3g} FLOP a sample",
        ),
        "writer": Rate(
            low=rates.WRITER_MBPS[fmt],
            high=rates.WRITER_MBPS[fmt],
            unit="MB/s raw a process",
            kind="measured",
            source=rates.RESULT,
        ),
        "loader": Rate(
            low=rates.LOADER_MBPS[fmt],
            high=rates.LOADER_MBPS[fmt],
            unit="MB/s raw a worker",
            kind="measured",
            source=rates.RESULT,
        ),
    }


def drafter_shape(config: PlanConfig, target: dict) -> memory.Shape:
    """The target's widths and those of the drafter train.py makes at the target's width."""
    hidden = target["hidden_size"]
    dc = drafter_config(
        hidden,
        target["vocab_size"],
        config.taps,
        config.drafter_layers,
        config.block_size,
        config.head,
        config.markov_rank,
    )
    return memory.Shape(
        hidden=hidden,
        intermediate=target.get("intermediate_size") or target["moe_intermediate_size"],
        vocab=target["vocab_size"],
        taps=config.taps,
        drafter_layers=config.drafter_layers,
        drafter_q=dc.num_attention_heads * dc.head_dim,
        drafter_kv=dc.num_key_value_heads * dc.head_dim,
        drafter_intermediate=dc.intermediate_size,
        drafter_parameters=drafter_parameters(dc),
        markov_rank=config.markov_rank if config.head == "dspark" else 0,
    )


def shard_split(config: PlanConfig) -> tuple[int, int]:
    """(shards, training shards); PlanError when the held-out shards leave a node none."""
    shards = math.ceil(config.rows / config.shard_rows)
    training = shards - config.eval_shards
    if training < config.nodes:
        raise PlanError(
            f"--eval-shards {config.eval_shards}: leaves {training} of {shards} shards for {config.nodes} nodes"
        )
    return shards, training


def check_share(config: PlanConfig, share: tuple[float, float], cache: float) -> None:
    """PlanError when a node's share of the training shards, at its largest, exceeds its cache."""
    if share[1] > cache:
        options = "more nodes or a larger disk" if config.hidden_format == "fp8" else "fp8, more nodes or a larger disk"
        raise PlanError(
            f"--hidden-format {config.hidden_format}: a node's share of the store, up to {share[1] / TB:.1f} TB, "
            f"is larger than its cache, {cache / TB:.1f} TB ({config.cache_share:.0%} of --local-disk-tb "
            f"{config.local_disk_tb:g}); use {options}"
        )


def stage_memory(config: PlanConfig, name: str, shape: memory.Shape, weights: int) -> tuple[int, dict]:
    """(capture batch in tokens, each stage's peak parts on one GPU); PlanError for what does not fit."""
    gpu = int(config.gpu_memory_gb * GB)
    if weights >= gpu:
        raise PlanError(f"--target {name}: {weights / GB:.1f} GB of bf16 weights do not fit a GPU of {gpu / GB:.0f} GB")
    batch = memory.capture_tokens(shape, weights, gpu)
    if batch < config.sample_tokens:
        need = memory.total(memory.capture(shape, weights, config.sample_tokens, cpu=False))
        raise PlanError(
            f"--gpu-memory-gb {config.gpu_memory_gb:g}: a capture forward of one {config.sample_tokens:,}-token "
            f"sample needs {need / GB:.1f} GB"
        )
    context, block = config.sample_tokens, config.block_size
    peaks = {
        "capture": memory.capture(shape, weights, batch, cpu=False),
        "training": memory.training(
            shape,
            config.optimizer,
            context,
            config.anchors,
            block,
            cpu=False,
            processes=config.nodes * config.gpus_per_node,
            final_state=config.final_state,
            markov_optimizer=config.markov_optimizer,
        ),
        "replay": memory.replay(shape, EVAL_PROMPTS, context, block, cpu=False),
    }
    for stage, parts in peaks.items():
        if memory.total(parts) > gpu:
            raise PlanError(
                f"--gpu-memory-gb {config.gpu_memory_gb:g}: {stage} needs {memory.total(parts) / GB:.1f} GB a GPU "
                f"({', '.join(f'{k} {v / GB:.1f}' for k, v in parts.items())})"
            )
    return batch, peaks


def stage_hours(config: PlanConfig, rate: dict[str, Rate], training_share: float) -> dict[str, tuple[float, float]]:
    """(low, high) GPU-hours of the references (prefill + decode), the capture and the training."""
    prefill = rates.gpu_hours(config.rows * config.prompt_tokens, rate["prefill"])
    decode = rates.gpu_hours(config.rows * config.completion_tokens, rate["decode"])
    samples = config.rows * training_share * config.epochs
    return {
        "references": (prefill[0] + decode[0], prefill[1] + decode[1]),
        "capture": rates.gpu_hours(config.rows * config.sample_tokens, rate["capture"]),
        "training": rates.gpu_hours(samples, rate["training"]),
    }


def run(config: PlanConfig) -> Plan:
    """Every figure of the plan; PlanError for the first part that does not fit."""
    name, target = target_config(config.target)
    params = parameters(target)
    weights, shape = params * memory.BF16, drafter_shape(config, target)
    batch, peaks = stage_memory(config, name, shape, weights)
    shards, training_shards = shard_split(config)
    raw = config.rows * config.sample_tokens * config.states * shape.hidden * memory.BF16
    stored = tuple(raw * r for r in rates.CODED[config.hidden_format])
    share = tuple(s * training_shards / shards / config.nodes for s in stored)
    cache = config.local_disk_tb * TB * config.cache_share
    check_share(config, share, cache)
    rate = stage_rates(config, params, shape)
    return Plan(
        config=config,
        name=name,
        parameters=params,
        weights=weights,
        shape=shape,
        shards=shards,
        training_shards=training_shards,
        raw=raw,
        stored=stored,
        share=share,
        cache=cache,
        capture_tokens=batch,
        memory=peaks,
        rates=rate,
        hours=stage_hours(config, rate, training_shards / shards),
    )
