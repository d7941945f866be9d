"""Everything a training run needs before its first step: the accelerator, the store (opened once
per process, with the run's node cache: the loader and validation read through it), its shards and
samples, the drafter config (from the store, --drafter-config, --init-from or a resumed step), the
model, optimizer and schedule, and the resume point."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline import device as devices
from pipeline.drafter import checkpoint
from pipeline.drafter.config import DrafterConfig, architecture_fields, default_sizes, read_config, store_mismatches
from pipeline.drafter.model import Drafter
from pipeline.drafter.serving_engines import kv_layout, serving_warnings, vllm_kv_problem
from pipeline.errors import DrafterError
from stages import cache_flags
from stages.out_contents import LAUNCH_MARK
from stages.paths import output_dir
from stages.settings import flag_of, with_role
from stages.train.config import DataConfig, DrafterArchConfig, RunConfig, TrainConfig
from stages.train.epoch_order import epoch_length
from stages.train.grad_comm import GradComm, install, step_bytes
from stages.train.loader import check_shared_memory, shared_memory_need
from stages.train.main_process import gather, on_main
from stages.train.node_order import check_shards, node_layout, shard_counts
from stages.train.optim import build_optimizers, build_schedules
from stages.train.position import Position, advance
from stages.train.run_dir import claim, load_training, resume_point
from stages.train.samples import Ref, refs_of
from stages.train.shard_schedule import FILE, ShardSchedule, schedule_of
from stages.train.step import LossPlan
from store import index_file
from store.errors import ConfigError, StoreError
from store.format.ranges import format_ranges, parse_ranges
from store.format.schema import StoreAttrs
from store.hidden_store import HiddenStore
from store.io.node_cache import NodeCache


@dataclass(kw_only=True)
class Setup:
    accelerator: object
    model: torch.nn.Module  # as prepared by Accelerate (DDP/FSDP wrapper)
    raw: Drafter
    optimizers: list  # as prepared by Accelerate (stages/train/optim.py)
    schedulers: list  # one per optimizer
    drafter_config: DrafterConfig
    store: HiddenStore  # this process's one store, read through by the loader and validation
    node_cache: NodeCache | None  # the run's node cache (--cache-dir) the store was opened with
    train_refs: list[Ref]  # the samples of the epoch the run starts in
    schedule: ShardSchedule  # every epoch's shards, and their samples (stages/train/shard_schedule.py)
    eval_refs: list[Ref]
    train_shards_text: str
    eval_shards_text: str
    store_fingerprint: str
    store_conditioning: str
    store_placement: str
    store_taps: tuple[int, ...]
    micro_per_epoch: int
    total_steps: int
    start_step: int
    plan: LossPlan
    position: Position = Position()  # where the data resumes (stages/train/position.py)
    local_processes: int = 1  # training processes on each node (LOCAL_WORLD_SIZE): --data-order node's layout
    skipped: set = field(default_factory=set)  # (shard, index) left out by --on-corrupt skip
    lock: object = None  # OUT's run lock (stages/train/run_dir.claim), main process only
    grad_comm: GradComm | None = None  # the gradients' all-reduce and its byte count; None alone


def make_accelerator(config: RunConfig, grad_accum: int):
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    cuda = torch.cuda.is_available()
    if not cuda:
        devices.prepare_cpu()
    precision = config.mixed_precision if config.mixed_precision != "auto" else ("bf16" if cuda else "no")
    trackers = ["tensorboard"] if importlib.util.find_spec("tensorboard") else []
    # Frozen embedding/lm_head buffers are identical on every rank: never re-broadcast them per step.
    # gradient_as_bucket_view: the gradients are views into DDP's all-reduce buckets (one copy, not two).
    warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated")
    acc = Accelerator(
        cpu=not cuda,
        mixed_precision=precision,
        gradient_accumulation_steps=grad_accum,
        log_with=trackers or None,
        project_dir=config.out,
        kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False, gradient_as_bucket_view=True)],
    )
    if not cuda:
        devices.prepare_cpu(config.threads or devices.default_threads(acc.num_processes))
    if trackers:
        acc.init_trackers("dflash")
    return acc


def select_shards(store: HiddenStore, config: DataConfig, records: dict) -> tuple[list[int], list[int]]:
    """(training shards, held-out shards) from --shards and --eval-shards, which may not share a
    shard; records: the store's commit records."""
    n = store.num_shards
    committed = sorted(records)
    eval_ids = parse_ranges(config.eval_shards, n, "--eval-shards") if config.eval_shards else []
    if config.shards:
        train_ids = parse_ranges(config.shards, n)
    else:
        train_ids = [s for s in committed if s not in set(eval_ids)]
    overlap = sorted(set(train_ids) & set(eval_ids))
    if overlap:  # held-out figures of prompts the drafter trains on would not be held out
        what = f"shard {format_ranges(overlap)} is" if len(overlap) == 1 else f"shards {format_ranges(overlap)} are"
        raise ConfigError(
            flag_of(config, "shards"),
            config.shards,
            f"{what} also in {flag_of(config, 'eval_shards')} {config.eval_shards}: a held-out shard "
            "cannot be trained on (leave --shards out to train on every committed shard not held out)",
        )
    if not train_ids:
        raise StoreError(
            f"{store.location}: no training shards (committed: {format_ranges(committed) or 'none'}, "
            f"--eval-shards {config.eval_shards or 'none'})"
        )
    return train_ids, eval_ids


def drafter_config(
    config: TrainConfig, attrs: StoreAttrs, resume_dir: Path | None
) -> tuple[DrafterConfig, dict | None]:
    """The drafter config and, for --init-from, its tensors; checked against the store."""
    tensors, arch = None, config.drafter
    if resume_dir is not None:
        dc, _ = read_config(resume_dir)
    elif arch.init_from:
        dc, tensors, _ = checkpoint.load(arch.init_from)
        check_head_kept(arch, dc)
    else:
        dc = fresh_config(arch, config.loss.block_size, attrs)
    check_against_store(dc, attrs, arch.init_from or resume_dir or "the drafter config")
    return with_target_facts(dc, attrs), tensors


def check_head_kept(arch: DrafterArchConfig, dc: DrafterConfig) -> None:
    """--init-from keeps the checkpoint's architecture (size flags are ignored), but a --head or
    --markov-rank that asks for another drafter is refused rather than silently not given."""
    asked = {"head": arch.head, "markov_rank": arch.markov_rank if dc.head == "dspark" else None}
    for name, value in asked.items():
        if value is not None and value != getattr(dc, name):
            raise ConfigError(
                flag_of(arch, name),
                value,
                f"{arch.init_from} is a drafter with {name} {getattr(dc, name)}, and --init-from keeps its"
                " architecture",
            )


def with_target_facts(dc: DrafterConfig, attrs: StoreAttrs) -> DrafterConfig:
    """What serving engines read from a drafter's config.json about its target, from the store:
    num_target_layers when the config does not say (the reference implementation and SGLang need
    it), and the target's max_position_embeddings (vLLM and SGLang size the drafter's rotary cache
    from it) unless the RoPE is a scaled type, whose math may depend on it."""
    if dc.num_target_layers is None:
        dc = dataclasses.replace(dc, num_target_layers=attrs.num_layers)
    length = attrs.target.max_position_embeddings
    if length and dc.rope_parameters.get("rope_type", "default") == "default":
        dc = dataclasses.replace(dc, max_position_embeddings=length)
    return dc


def fresh_config(config: DrafterArchConfig, block_size: int, attrs: StoreAttrs) -> DrafterConfig:
    """A new drafter of block_size (--block-size) for this store: sizes from --drafter-config (every
    architecture field of it) or from the store's hidden size, then the flags that were given."""
    if config.drafter_config:
        base, _ = read_config(config.drafter_config)
        arch = {k: getattr(base, k) for k in architecture_fields()}
    else:
        arch = default_sizes(attrs.hidden_size)
        arch.update(layer_types=("full_attention",) * arch["num_hidden_layers"])
    given = {target: getattr(config, name) for name, target in with_role(DrafterArchConfig, "drafter").items()}
    arch.update({k: v for k, v in given.items() if v is not None})
    if config.num_heads is not None and config.num_kv_heads is None:
        arch["num_key_value_heads"] = max(1, config.num_heads // 4)
    if config.layer_types is not None or len(arch["layer_types"]) != arch["num_hidden_layers"]:
        arch["layer_types"] = layer_types(config.layer_types or "full", arch["num_hidden_layers"])
    if config.rope_theta is not None:
        arch["rope_parameters"] = {
            **arch.get("rope_parameters", DrafterConfig.default_rope()),
            "rope_theta": config.rope_theta,
        }
    dc = DrafterConfig(
        hidden_size=attrs.hidden_size,
        vocab_size=attrs.vocab_size,
        block_size=block_size,
        mask_token_id=config.mask_token_id if config.mask_token_id is not None else attrs.mask_token_id,
        target_layer_ids=attrs.taps,
        num_target_layers=attrs.num_layers,
        **arch,
    )
    sized = (config.num_heads, config.num_kv_heads, config.head_dim)
    chosen = config.drafter_config or any(v is not None for v in sized)
    return dc if chosen else servable_in_vllm(dc, attrs.target)


def servable_in_vllm(dc: DrafterConfig, target) -> DrafterConfig:
    """The default sizes, with the target's full-attention KV layout (KV heads, head_dim) when vLLM
    would not cache the drafter's layers in one group otherwise (serving_engines.vllm_kv_problem). The
    query heads keep about the hidden size."""
    layout = kv_layout(target)
    if layout is None or vllm_kv_problem(dc, target) is None:
        return dc
    kv, head_dim = layout
    heads = max(kv, dc.hidden_size // head_dim // kv * kv)
    return dataclasses.replace(dc, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim)


def layer_types(text: str, n: int) -> tuple[str, ...]:
    names = {"full": "full_attention", "sliding": "sliding_attention"}
    parts = [p.strip() for p in text.split(",")]
    if len(parts) == 1:
        parts = parts * n
    if len(parts) != n or any(p not in names for p in parts):
        raise ConfigError("--layer-types", repr(text), f"expected 'full', 'sliding' or {n} comma-separated of those")
    return tuple(names[p] for p in parts)


def check_against_store(dc: DrafterConfig, attrs: StoreAttrs, where) -> None:
    """Taps, hidden size and vocabulary must be the store's (the mask token may be --mask-token-id)."""
    diff = store_mismatches(dc, attrs)
    labels = {"taps": "target_layer_ids (taps)", "hidden_size": "hidden_size", "vocab_size": "vocab_size"}
    bad = [f"{label}: drafter has {diff[k][0]}, store has {diff[k][1]}" for k, label in labels.items() if k in diff]
    if bad:
        raise DrafterError(f"{where} does not fit the store: " + "; ".join(bad))


def prepare(config: TrainConfig, log) -> Setup:
    if devices.Process.from_env().rank == 0:
        output_dir(config.run.out, "--out")  # before any work: OUT's lock, metrics and checkpoints go there
    lock = claim(Path(config.run.out))
    try:
        return dataclasses.replace(_prepare(config, log), lock=lock)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _prepare(config: TrainConfig, log) -> Setup:
    data, optim, out = config.data, config.optim, Path(config.run.out)
    cache = cache_flags.make(data)
    store = HiddenStore(data.store, node_cache=cache)  # once per process (loader workers open their own)
    attrs = store.attrs
    if config.loss.soft_targets != "none":
        store.require_final_state("--soft-targets", config.loss.soft_targets, "the target's distribution")
    acc = make_accelerator(config.run, optim.grad_accum)
    shared_out(acc, out)
    rdir, previous = on_main(acc, lambda: resume_point(config, attrs.fingerprint))  # one decides, all follow
    dc, init = drafter_config(config, attrs, rdir)
    index, where = on_main(acc, lambda: index_file.load(store))  # by one process: the index file, else every shard's
    records = index.records
    if acc.is_main_process:
        log(where)
    for line in [
        *serving_warnings(dc, attrs.target),
        *filter(None, [store.read_checks(records).warning(), cache_flags.warning(data, store)]),
    ]:
        log(f"warning: {line}")
    train_ids, eval_ids = select_shards(store, data, records)
    store.require_committed(
        [s for s in eval_ids + ([] if config.shard_schedule.follow else train_ids) if s not in records]
    )
    position = resume_position(config, lambda e: refs_of(index.arrays, train_ids, data.max_length), previous)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # this node's training processes (torchrun, accelerate)
    layout = node_layout(acc.num_processes, local)
    schedule = schedule_of(config, store, train_ids, index, position.schedule)
    schedule.wait_for_start(
        acc,
        lambda refs: (
            epoch_length(data, refs, 0, layout) // acc.num_processes >= optim.grad_accum
            and len(shard_counts(refs.shard)) >= layout[0]
        ),
        log,
    )
    if schedule.mode == "replay" and acc.is_main_process:
        schedule.write(out / FILE)
    train_refs, eval_refs = schedule.refs(position.epoch), refs_of(index.arrays, eval_ids, data.max_length)
    if not train_refs:
        raise StoreError(f"{data.store}: shards {format_ranges(train_ids)} hold no sample with a completion")
    check_shared_memory(
        data,
        shared_memory_need(
            data,
            train_refs + eval_refs,
            len(attrs.taps) + (config.loss.soft_targets != "none"),
            attrs.hidden_size,
            local,
        ),
    )
    check_shards(data, train_refs.shard, layout)
    micro = epoch_length(data, train_refs, 0, layout) // acc.num_processes  # each rank's batches of epoch 0
    if micro < optim.grad_accum:
        raise ConfigError(
            flag_of(optim, "grad_accum"),
            optim.grad_accum,
            f"{len(train_refs)} training samples make only {micro} batch(es) per rank (batch size "
            f"{data.batch_size}, {acc.num_processes} ranks)",
        )
    # a resumed run keeps its step count (its schedule was built for it), on any number of processes
    total = (
        previous["total_steps"] if previous else config.run.max_steps or config.run.epochs * (micro // optim.grad_accum)
    )
    embed, lm_head = frozen_tensors(store, acc.device)  # [V, H] each, on the device
    raw, model, opts, scheds = build_model(config, acc, dc, embed, lm_head, init, total)
    start = 0
    if rdir is not None:
        load_training(rdir / "training", acc, raw, opts, scheds)
        start = previous["step"]
        finished = (out / "final" / "config.json").exists()
        if start > total or (start == total and finished):  # at the end without final/: only finish() is redone
            raise ConfigError("--resume", rdir, f"already at step {start} of {total}")
    if acc.is_main_process:
        n_params = sum(p.numel() for p in raw.parameters())
        log(
            (
                f"resumed from {rdir} at step {start}"
                + (
                    f" (saved on {previous['world_size']} processes)"
                    if previous["world_size"] != acc.num_processes
                    else ""
                )
                + "\n"
                if rdir
                else ""
            )
            + (
                f"--resume: no complete step-N in {config.run.out} yet, starting from step 0\n"
                if config.run.resume and not rdir
                else ""
            )
            + f"drafter: {dc.num_hidden_layers} layers, hidden {dc.hidden_size}, {n_params / 1e6:.2f}M trainable "
            f"parameters; taps {list(dc.target_layer_ids)}; {len(train_refs)} training samples in shards "
            f"{format_ranges(list(schedule.shards(position.epoch)))}"
            + (
                f" (epoch {position.epoch}'s; --shards {data.shards}, "
                f"{'followed' if config.shard_schedule.follow else 'scheduled'} epoch by epoch, "
                f"recorded in {out / FILE})"
                if schedule.mode != "fixed"
                else ""
            )
            + (f", {len(eval_refs)} held out in {format_ranges(eval_ids)}" if eval_ids else "")
            + f"; {total} steps on {acc.num_processes} process(es), {acc.device}"
            + (
                f"; gradients all-reduced in {optim.grad_comm}, {step_bytes(raw, optim.grad_comm) / 1e9:.3g} GB a "
                "step per process"
                if acc.num_processes > 1
                else ""
            )
        )
    return Setup(
        accelerator=acc,
        model=model,
        raw=raw,
        optimizers=opts,
        schedulers=scheds,
        drafter_config=dc,
        store=store,
        node_cache=cache,
        train_refs=train_refs,
        schedule=schedule,
        eval_refs=eval_refs,
        train_shards_text=format_ranges(train_ids),
        eval_shards_text=format_ranges(eval_ids),
        store_fingerprint=attrs.fingerprint,
        store_conditioning=attrs.compat.conditioning(),
        store_placement=attrs.compat.placement(),
        store_taps=attrs.taps,
        micro_per_epoch=micro,
        total_steps=total,
        start_step=start,
        position=position,
        local_processes=local,
        plan=LossPlan.of(config.loss, dc, acc.device.type == "cuda", data.batching == "packed"),
        grad_comm=install(model, optim.grad_comm),
    )


def resume_position(config: TrainConfig, refs, previous: dict | None) -> Position:
    """Where the data continues: the saved position; for a checkpoint from before positions were
    saved, its step walked on the number of processes it was saved with. refs: the samples, or
    epoch -> the samples (position.advance)."""
    if previous is None:
        return Position()
    if "position" in previous:
        return Position.from_json(previous["position"])
    return advance(config.data, refs, Position(), previous["step"] * config.optim.grad_accum, previous["world_size"])


def shared_out(acc, out: Path) -> None:
    """Every process must see the same OUT (each writes its training state into step-N): the main
    process writes a token there, and a rank that does not read it back stops the launch, naming OUT."""
    if acc.num_processes == 1:
        return
    mark = out / LAUNCH_MARK

    def write() -> str:
        out.mkdir(parents=True, exist_ok=True)
        token = uuid.uuid4().hex
        mark.write_text(token)
        return token

    token = on_main(acc, write)
    seen = mark.read_text() if mark.exists() else None
    blind = [r for r, ok in enumerate(gather(acc, seen == token)) if not ok]
    if blind:
        raise ConfigError(
            "--out",
            out,
            f"is not shared by every process: rank(s) {blind} do not see {mark} that the "
            "main process wrote; put --out on a file system every node mounts",
        )


def frozen_tensors(store: HiddenStore, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embed_tokens and lm_head, [V, H] each, on the device: bf16 on GPU, fp32 on CPU.
    Each is moved as soon as it is read, so the host holds one at a time and nothing else: the read
    on GPU (freed once moved); on CPU the read and its fp32 conversion, a copy by necessity."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    embed = store.embedding("embed_tokens").to(device, dtype)
    return embed, store.embedding("lm_head").to(device, dtype)


def build_model(config: TrainConfig, acc, dc: DrafterConfig, embed, lm_head, init: dict | None, total: int):
    """The drafter (fp32 master weights; embed, lm_head as frozen_tensors gives them, kept without a
    copy), its optimizers and their schedules (optim.py), prepared by Accelerate. The schedulers are
    stepped by us once per optimizer step (Accelerate would step them once per process) and saved
    with the training state."""
    torch.manual_seed(config.data.seed)
    with torch.device(acc.device):  # parameters made on the device: no host copy of the fp32 drafter (6.9 GB at 27B)
        raw = Drafter(dc, embed, lm_head)
    raw.init_weights(torch.Generator().manual_seed(config.data.seed))  # values from a CPU generator, on any device
    if init is not None:
        checkpoint.load_into(raw, init)
    raw.to(acc.device)
    raw.checkpoint_layers = config.run.grad_checkpoint
    opts = build_optimizers(config.optim, raw)
    scheds = build_schedules(config.optim, opts, total)
    model, *opts = acc.prepare(raw, *opts)
    for sched in scheds:
        acc.register_for_checkpointing(sched)
    return raw, model, opts, scheds
