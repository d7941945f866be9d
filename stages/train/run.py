"""Stage two: train the DFlash drafter purely from the store, with Accelerate.

No target model is loaded: tokens, loss masks, tap states, the frozen embedding and lm_head all
come from the store, and the store's fingerprint goes into every checkpoint. A run writes
OUT/metrics.jsonl, OUT/step-N/ every --save-every steps (a drafter checkpoint plus the training
state, published by a rename) and OUT/final/.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from pipeline.drafter.loss import summarize, zero_sums
from pipeline.errors import TrainingError
from stages.train.config import TrainConfig
from stages.train.data import loader
from stages.train.optim import Muon
from stages.train.position import rank_batches
from stages.train.run_dir import MetricsLog, export, save_step, write_audit
from stages.train.setup import Setup, prepare
from stages.train.step import forward_loss, step_generator
from stages.train.validation import validate

INTERRUPTED = "interrupted; rerun with --resume to continue from the last step-N"


def run(config: TrainConfig, log=print) -> dict:
    s = prepare(config, log)
    try:
        return _run(s, config)
    finally:
        if s.lock is not None:
            s.lock.release()


def _run(s: Setup, config: TrainConfig) -> dict:
    acc, out = s.accelerator, Path(config.out)
    metrics = MetricsLog(acc, out, s.start_step, s.total_steps)
    if s.eval_refs and s.start_step == 0:
        # a fresh drafter drafts nothing yet: replaying it would cost the most rounds (one a token) to show tau ~1
        metrics.write({"split": "eval", "step": 0, **validate(s, config, replay=bool(config.init_from))})
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
                metrics.write({"split": "eval", "step": done, **validate(s, config)})
            if config.save_every and done % config.save_every == 0:
                save_step(s, config, done)
            window.t0 += time.perf_counter() - t_side  # tokens/s counts training time only
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
            out = forward_loss(s.model, s.raw, batch, s.plan, gen)
            check_finite(out.loss, step, micro, batch)
            acc.backward(out.loss)
            if acc.sync_gradients and config.grad_clip > 0:
                acc.clip_grad_norm_(s.model.parameters(), config.grad_clip)
            for opt in s.optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
        sums = sums + out.sums
    for sched in s.schedulers:
        sched.step()
    return sums, tokens


def check_finite(loss: torch.Tensor, step: int, micro: int, batch) -> None:
    """Stop before a non-finite loss reaches the weights (the host already waits for this micro-batch:
    its token count is read back), naming the step and the samples."""
    if not bool(torch.isfinite(loss.detach())):
        refs = ", ".join(f"shard {a} sample {b}" for a, b in batch.refs.tolist())
        raise TrainingError(f"step {step + 1}, micro-batch {micro}: the loss is {float(loss):.4g}, not finite; the "
                            f"batch held {refs} (check them with `pipeline verify`; lower --lr, or --resume from "
                            "the last step-N)")


class Window:
    """Loss statistics since the last record, summed over ranks when flushed."""

    def __init__(self, s: Setup) -> None:
        self.s = s
        self.sums = zero_sums(s.drafter_config.block_size, s.accelerator.device)
        self.tokens, self.t0 = 0, time.perf_counter()
        self.steps, self.sent0 = 0, self.sent()

    def sent(self) -> dict[str, int]:
        """This process's bytes between processes so far: the gradients' all-reduce, Muon's broadcast."""
        muon = [o for o in (getattr(o, "optimizer", o) for o in self.s.optimizers) if isinstance(o, Muon)]
        return {"grad_comm_bytes_per_step": self.s.grad_comm.bytes,
                "muon_broadcast_bytes_per_step": sum(o.broadcast_bytes for o in muon)} if self.s.grad_comm else {}

    def add(self, sums: torch.Tensor, tokens: int) -> None:
        self.sums += sums
        self.tokens += tokens
        self.steps += 1

    def flush(self, step: int) -> dict:
        s, acc = self.s, self.s.accelerator
        m = summarize(acc.reduce(self.sums, reduction="sum"))
        tokens = int(acc.reduce(torch.tensor(self.tokens, device=acc.device), reduction="sum"))
        epoch = step * acc.gradient_accumulation_steps / s.micro_per_epoch
        record = {"split": "train", "step": step, "epoch": round(epoch, 3), "lr": s.schedulers[-1].get_last_lr()[0],
                  **({"muon_lr": s.schedulers[0].get_last_lr()[0]} if len(s.schedulers) > 1 else {}), **m,
                  "tokens_per_s": round(tokens / (time.perf_counter() - self.t0), 1), "time": time.time(),
                  "corrupt_skipped": corrupt_skipped(s)}
        now = self.sent()
        record.update({k: (v - self.sent0[k]) // max(1, self.steps) for k, v in now.items()})
        self.sums.zero_()
        self.tokens, self.t0 = 0, time.perf_counter()
        self.steps, self.sent0 = 0, now
        return record


def corrupt_skipped(s: Setup) -> int:
    """Samples left out by --on-corrupt skip so far, summed over processes (a collective: every rank calls it)."""
    return int(s.accelerator.reduce(torch.tensor(len(s.skipped), device=s.accelerator.device), reduction="sum"))


def finish(s: Setup, config: TrainConfig, metrics: MetricsLog, seen: list) -> dict:
    """Final validation, the last step checkpoint, OUT/final, the curve, audit files."""
    acc, out = s.accelerator, Path(config.out)
    final = {"split": "eval", "step": s.total_steps, **validate(s, config)} if s.eval_refs else None
    if final:
        metrics.write(final)
    if config.save_every and s.total_steps % config.save_every:
        save_step(s, config, s.total_steps)
    export(s, config, out / "final", s.total_steps)
    if acc.is_main_process:
        try:
            from stages.plots import learning_curve
        except ImportError:  # matplotlib is a dependency, but a bare GPU image may lack it
            learning_curve = None
        if learning_curve is not None:
            learning_curve(metrics.path, out / "curve.png", title=f"{config.store} shards {s.train_shards_text}")
    if config.audit:
        write_audit(s, out, seen)
    skipped = corrupt_skipped(s)
    acc.wait_for_everyone()
    acc.end_training()
    return {"out": str(out), "steps": s.total_steps, "final_eval": final, "world_size": acc.num_processes,
            "main_process": acc.is_main_process, "corrupt_skipped": skipped}


def done_line(summary: dict) -> str:
    """The last line a run prints: steps, where the drafter is, the held-out figures."""
    ev = summary["final_eval"]
    return (f"done: {summary['steps']} steps, checkpoint {summary['out']}/final"
            + (f"; held-out loss {ev['loss']:.4f}, streak tau {ev['tau_streak']:.3f}" if ev else "")
            + (f", replay tau {ev['tau_replay']:.3f} ({ev['replay_prompts']} prompts)" if ev and "tau_replay" in ev
               else "")
            + (f"; {summary['corrupt_skipped']} corrupt sample(s) left out (--on-corrupt skip; run `pipeline verify`)"
               if summary.get("corrupt_skipped") else ""))


def micro_batches(s: Setup, config: TrainConfig):
    """This rank's micro-batches from the run's position on (stages/train/position.py), through the
    epochs, worker processes reading."""
    acc, epoch = s.accelerator, s.position.epoch
    while True:
        mine = rank_batches(config, s.train_refs, s.position, epoch, acc.process_index, acc.num_processes)
        if mine:
            yield from loader(config, mine, acc.device.type == "cuda", s.skipped)
        epoch += 1
