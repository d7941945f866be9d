"""Stage two: train the DFlash drafter purely from the store, with Accelerate.

No target model is loaded: tokens, loss masks, tap states, the frozen embedding and lm_head all
come from the store, and the store's fingerprint goes into every checkpoint. A run writes
OUT/metrics.jsonl, OUT/step-N/ every --save-every steps (a drafter checkpoint plus the training
state, published by a rename) and OUT/final/.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from pipeline import masks
from pipeline.blocks import make_blocks, sample_anchors
from pipeline.drafter import Drafter
from pipeline.drafter_config import default_gamma
from pipeline.errors import PipelineError
from pipeline.loss import dflash_loss, summarize, zero_sums
from stages.run_dir import MetricsLog, export, save_step, write_audit
from stages.train_setup import Setup, prepare
from store.batches import StoreBatches, epoch_batches

CTX_BUCKET = 512  # flex (CUDA): context lengths are rounded up to this
_STOP_ENV = "DFLASH_TEST_STOP_AFTER_STEP"  # test hook: stop as if interrupted once this step is done


@dataclass(frozen=True)
class TrainConfig:
    store: str = "hs.zarr"
    out: str = "runs/drafter"
    shards: str | None = None  # None: every committed shard not in eval_shards
    eval_shards: str | None = None
    max_steps: int | None = None  # overrides epochs
    epochs: int = 6
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    block_size: int = 16
    gamma: float | None = None  # None: SPEC's table (7 for 16, 5 for 10, 4 for 8)
    anchors: int = 512
    max_length: int = 4096
    batch_size: int = 1  # sequences per rank per micro-batch
    grad_accum: int = 1
    seed: int = 0
    noise_std: float = 0.0
    save_every: int = 1000  # 0: only OUT/final
    eval_every: int = 0  # 0: before training and at the end only
    log_every: int = 10
    workers: int = 2
    threads: int | None = None  # CPU intra-op threads per process; None: $OMP_NUM_THREADS, else cores / processes
    # drafter (None: defaults that suit the store's hidden size; --init-from/--drafter-config give sizes)
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    layer_types: str | None = None  # None: --drafter-config's, else all full attention
    sliding_window: int | None = None
    rope_theta: float | None = None  # None: --drafter-config's, else 1e6
    mask_token_id: int | None = None  # None: the store's
    init_from: str | None = None
    drafter_config: str | None = None
    resume: str | None = None  # "latest" or a step directory
    mixed_precision: str = "auto"  # auto: bf16 autocast on GPU, fp32 on CPU
    audit: bool = False  # OUT/audit/rank-N.json: world size, samples read, parameter hash

    def validate(self) -> None:
        for name in ("epochs", "lr", "block_size", "anchors", "max_length", "batch_size", "grad_accum", "log_every"):
            if getattr(self, name) <= 0:
                raise PipelineError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be positive")
        if self.max_steps is not None and self.max_steps < 1:
            raise PipelineError(f"--max-steps {self.max_steps}: must be at least 1")
        if not 0 <= self.warmup_ratio < 1:
            raise PipelineError(f"--warmup-ratio {self.warmup_ratio}: expected 0 <= ratio < 1")
        if self.noise_std < 0:
            raise PipelineError(f"--noise-std {self.noise_std}: must be >= 0")
        if self.mixed_precision not in ("auto", "bf16", "no"):
            raise PipelineError(f"--mixed-precision {self.mixed_precision}: expected auto, bf16 or no")
        if self.gamma is not None and self.gamma <= 0:
            raise PipelineError(f"--gamma {self.gamma}: must be positive")
        if self.gamma is None and self.init_from is None:
            default_gamma(self.block_size)  # a block size without a default needs --gamma


def loss_gamma(config: TrainConfig, block_size: int) -> float:
    """--gamma, else SPEC's value for the drafter's block size (an --init-from checkpoint's own)."""
    return config.gamma if config.gamma is not None else default_gamma(block_size)


def step_generator(seed: int, step: int, micro: int, rank: int, device: torch.device) -> torch.Generator:
    """Anchors and noise depend only on (seed, step, micro-batch, rank): resume-exact."""
    g = torch.Generator(device=device)
    g.manual_seed(((seed * 1_000_003 + step) * 1009 + micro) * 101 + rank)
    return g


def forward_loss(model, raw: Drafter, batch, config: TrainConfig, dc, gen, flex: bool):
    """One micro-batch -> LossOut. batch tensors are on the model's device."""
    anchors, valid = sample_anchors(batch.loss_mask.cpu(), config.anchors, generator=_cpu(gen))
    ctx_len = int(anchors.max())  # keys at or past the last anchor are never visible (strict <)
    if flex:  # few distinct shapes, so the compiled kernel is not rebuilt for every batch
        anchors, valid, ctx_len = pad_for_compile(anchors, valid, ctx_len, config.anchors)
    anchors, valid = anchors.to(batch.tokens.device), valid.to(batch.tokens.device)
    blocks = make_blocks(batch.tokens, batch.loss_mask, anchors, valid, dc.block_size, dc.mask_token_id)
    hidden = batch.hidden[:, :ctx_len]  # [b, S, n_taps, H] bf16
    if hidden.shape[1] < ctx_len:  # padded keys: zeros, never visible (kv < anchor <= length)
        hidden = torch.nn.functional.pad(hidden, (0, 0, 0, 0, 0, ctx_len - hidden.shape[1]))
    ctx_pos = torch.arange(ctx_len, device=hidden.device)[None].expand(hidden.shape[0], -1)
    noise = None
    if config.noise_std > 0 and model.training:
        noise = torch.randn(hidden.shape, generator=gen, device=hidden.device) * config.noise_std
    mask = masks.build(raw.rules, anchors, valid, ctx_len, dc.block_size, "flex" if flex else "local")
    h = model(hidden, blocks.block_ids, ctx_pos, blocks.positions, mask, noise)
    return dflash_loss(h, blocks.labels, raw.lm_head, loss_gamma(config, dc.block_size))


def pad_for_compile(anchors, valid, ctx_len: int, n: int, multiple: int = CTX_BUCKET):
    """Anchors padded to n (invalid), the context length rounded up to a multiple."""
    pad = n - anchors.shape[1]
    if pad > 0:
        anchors = torch.nn.functional.pad(anchors, (0, pad))
        valid = torch.nn.functional.pad(valid, (0, pad))
    return anchors, valid, -(-max(ctx_len, 1) // multiple) * multiple


def _cpu(gen: torch.Generator) -> torch.Generator:
    if gen.device.type == "cpu":
        return gen
    g = torch.Generator()
    g.manual_seed(gen.initial_seed())
    return g


def run(config: TrainConfig, log=print) -> dict:
    s = prepare(config, log)
    acc, out = s.accelerator, Path(config.out)
    metrics = MetricsLog(acc, out, s.start_step)
    if s.eval_refs and s.start_step == 0:
        metrics.write({"split": "eval", "step": 0, **evaluate(s, config)})
    bar = tqdm(total=s.total_steps, initial=s.start_step, unit="step", desc="train", dynamic_ncols=True,
               disable=not acc.is_main_process)
    window, seen = Window(s), []
    batches = micro_batches(s, config)
    try:
        for step in range(s.start_step, s.total_steps):
            window.add(*train_step(s, config, batches, step, seen if config.audit else None))
            done = step + 1
            bar.update(1)
            if done % config.log_every == 0 or done == s.total_steps:
                record = window.flush(done)
                metrics.write(record)
                bar.set_postfix(loss=f"{record['loss']:.3f}", tau=f"{record['tau_streak']:.2f}")
            t_side = time.perf_counter()
            if s.eval_refs and config.eval_every and done % config.eval_every == 0 and done != s.total_steps:
                metrics.write({"split": "eval", "step": done, **evaluate(s, config)})
            if config.save_every and done % config.save_every == 0:
                save_step(s, config, done)
            window.t0 += time.perf_counter() - t_side  # tokens/s counts training time only
            if os.environ.get(_STOP_ENV) == str(done):
                raise KeyboardInterrupt(f"{_STOP_ENV}={done}")
    finally:
        bar.close()
    return finish(s, config, metrics, seen)


def train_step(s: Setup, config: TrainConfig, batches, step: int, seen: list | None):
    """One optimizer step over --grad-accum micro-batches -> (summed loss stats, tokens read)."""
    acc = s.accelerator
    s.model.train()
    sums, tokens = 0, 0
    for micro in range(config.grad_accum):
        batch = next(batches).to(acc.device)
        if seen is not None:
            seen += batch.refs.tolist()
        tokens += int(batch.lengths.sum())
        with acc.accumulate(s.model):
            gen = step_generator(config.seed, step, micro, acc.process_index, acc.device)
            out = forward_loss(s.model, s.raw, batch, config, s.drafter_config, gen, s.flex)
            acc.backward(out.loss)
            if acc.sync_gradients and config.grad_clip > 0:
                acc.clip_grad_norm_(s.model.parameters(), config.grad_clip)
            s.optimizer.step()
            s.optimizer.zero_grad(set_to_none=True)
        sums = sums + out.sums
    s.scheduler.step()
    return sums, tokens


class Window:
    """Loss statistics since the last record, summed over ranks when flushed."""

    def __init__(self, s: Setup) -> None:
        self.s = s
        self.sums = zero_sums(s.drafter_config.block_size, s.accelerator.device)
        self.tokens, self.t0 = 0, time.perf_counter()

    def add(self, sums: torch.Tensor, tokens: int) -> None:
        self.sums += sums
        self.tokens += tokens

    def flush(self, step: int) -> dict:
        s, acc = self.s, self.s.accelerator
        m = summarize(acc.reduce(self.sums, reduction="sum"))
        tokens = int(acc.reduce(torch.tensor(self.tokens, device=acc.device), reduction="sum"))
        epoch = step * acc.gradient_accumulation_steps / s.micro_per_epoch
        record = {"split": "train", "step": step, "epoch": round(epoch, 3), "lr": s.scheduler.get_last_lr()[0], **m,
                  "tokens_per_s": round(tokens / (time.perf_counter() - self.t0), 1), "time": time.time()}
        self.sums.zero_()
        self.tokens, self.t0 = 0, time.perf_counter()
        return record


def finish(s: Setup, config: TrainConfig, metrics: MetricsLog, seen: list) -> dict:
    """Final validation, the last step checkpoint, OUT/final, the curve, audit files."""
    acc, out = s.accelerator, Path(config.out)
    final = {"split": "eval", "step": s.total_steps, **evaluate(s, config)} if s.eval_refs else None
    if final:
        metrics.write(final)
    if config.save_every and s.total_steps % config.save_every:
        save_step(s, config, s.total_steps)
    export(s, config, out / "final", s.total_steps)
    if acc.is_main_process:
        try:
            from pipeline.plots import learning_curve
        except ImportError:  # matplotlib is a dependency, but a bare GPU image may lack it
            learning_curve = None
        if learning_curve is not None:
            learning_curve(metrics.path, out / "curve.png", title=f"{config.store} shards {s.train_shards_text}")
    if config.audit:
        write_audit(s, out, seen)
    acc.wait_for_everyone()
    acc.end_training()
    return {"out": str(out), "steps": s.total_steps, "final_eval": final, "world_size": acc.num_processes}


def micro_batches(s: Setup, config: TrainConfig):
    """This rank's micro-batches from the resume point on, through epochs, worker processes reading."""
    m = s.start_step * config.grad_accum
    epoch, offset = divmod(m, s.micro_per_epoch)
    acc = s.accelerator
    while True:
        mine = epoch_batches(s.train_refs, config.batch_size, config.seed, epoch, acc.process_index, acc.num_processes)
        loader = torch.utils.data.DataLoader(
            StoreBatches(config.store, mine[offset:]), batch_size=None, shuffle=False, num_workers=config.workers,
            pin_memory=acc.device.type == "cuda", prefetch_factor=4 if config.workers else None)
        yield from loader
        epoch, offset = epoch + 1, 0


@torch.no_grad()
def evaluate(s: Setup, config: TrainConfig) -> dict:
    """Loss, streak tau and per-slot accuracy on the held-out shards, with fixed anchors."""
    acc = s.accelerator
    s.model.eval()
    batches = epoch_batches(s.eval_refs, config.batch_size, config.seed, 0)[acc.process_index::acc.num_processes]
    total = zero_sums(s.drafter_config.block_size, acc.device)
    data = StoreBatches(config.store, batches)
    for i in range(len(data)):
        batch = data[i].to(acc.device)
        gen = step_generator(config.seed, -1, i, acc.process_index, acc.device)
        with acc.autocast():
            total += forward_loss(s.model, s.raw, batch, config, s.drafter_config, gen, s.flex).sums
    return summarize(acc.reduce(total, reduction="sum"))
