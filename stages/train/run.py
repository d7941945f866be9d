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

from pipeline import device as devices
from pipeline.drafter.loss import summarize, zero_sums
from pipeline.errors import TrainingError
from stages.command import Interrupted
from stages.out_contents import LAUNCH_MARK
from stages.out_dir import removed_if_failed_empty
from stages.train.config import DataConfig, TrainConfig
from stages.train.loader import loader
from stages.train.optim import Muon
from stages.train.position import last_epoch_read, rank_batches
from stages.train.recipe import INTERRUPTED, NOTHING_SAVED  # noqa: F401 - INTERRUPTED: the interrupted line (train.py)
from stages.train.run_dir import MetricsLog, epochs_at, latest_step, save_step, write_audit, write_drafter
from stages.train.setup import Setup, prepare
from stages.train.step import forward_loss, step_generator
from stages.train.validation import validate


def run(config: TrainConfig, log=print) -> dict:
    """A failed run removes OUT again if it created it and left it empty (main process). An interrupted
    one says to --resume only when a step-N exists to resume from."""
    main = devices.Process.from_env().rank == 0
    try:
        with removed_if_failed_empty(config.run.out, scratch=(LAUNCH_MARK,), owner=main):
            setup = prepare(config, log)
            try:
                return _run(setup, config, log)
            finally:
                if setup.lock is not None:
                    setup.lock.release()
    except KeyboardInterrupt:
        if latest_step(Path(config.run.out)) is None:
            raise Interrupted(NOTHING_SAVED) from None
        raise


def _run(setup: Setup, config: TrainConfig, log) -> dict:
    acc, out = setup.accelerator, Path(config.run.out)
    metrics = MetricsLog(acc, out, setup.start_step, setup.total_steps)
    if setup.eval_refs and setup.start_step == 0:
        # a fresh drafter drafts nothing yet: replaying it would cost the most rounds (one a token) to show tau ~1
        metrics.write({"split": "eval", "step": 0, **validate(setup, config, replay=bool(config.drafter.init_from))})
    bar = tqdm(
        total=setup.total_steps,
        initial=setup.start_step,
        unit="step",
        desc="train",
        dynamic_ncols=True,
        disable=not acc.is_main_process,
    )
    window, seen = Window(setup, config), []
    batches = micro_batches(setup, config.data, lambda line: under_bar(bar, log, line))
    try:
        for step in range(setup.start_step, setup.total_steps):
            window.add(*train_step(setup, config, batches, step, seen if config.run.audit else None))
            done = step + 1
            bar.update(1)
            if done % config.run.log_every == 0 or done == setup.total_steps:
                record = window.flush(done)
                metrics.write(record)
                bar.set_postfix(loss=f"{record['loss']:.3f}", tau=f"{record['tau_streak']:.2f}")
            t_side = time.perf_counter()
            every = config.run.eval_every
            if setup.eval_refs and every and done % every == 0 and done != setup.total_steps:
                metrics.write({"split": "eval", "step": done, **validate(setup, config)})
            if config.run.save_every and done % config.run.save_every == 0:
                save_step(setup, config, done)
            window.t0 += time.perf_counter() - t_side  # tokens/s counts training time only
    finally:
        bar.close()
    return finish(setup, config, metrics, seen)


def under_bar(bar, log, line: str) -> None:
    """A line said while the progress bar is drawn: on a line of its own, the bar drawn again below it."""
    bar.clear()
    log(line)
    bar.refresh()


def train_step(setup: Setup, config: TrainConfig, batches, step: int, seen: list | None):
    """One optimizer step over --grad-accum micro-batches -> (summed loss stats on the device, tokens
    read). The host never waits for the device here: token counts and anchors come from the batch
    as the loader gave it (host memory), and each loss's finiteness is read back at the optimizer
    step through `FiniteLoss` (the forward long done by then); the sums are read at log time."""
    acc = setup.accelerator
    setup.model.train()
    sums, tokens, losses = 0, 0, []
    for micro in range(config.optim.grad_accum):
        host = next(batches)  # the loader's batch, in (pinned) host memory
        batch = host.to(acc.device)
        if seen is not None:
            seen += host.refs.tolist()
        tokens += int(host.lengths.sum())
        with acc.accumulate(setup.model):
            gen = step_generator(config.data.seed, step, micro, acc.process_index, acc.device)
            out = forward_loss(setup.model, setup.raw, batch, setup.plan, gen, host=host)
            losses.append(FiniteLoss(out.loss, step, micro, host))
            acc.backward(out.loss)
            if acc.sync_gradients:
                for loss in losses:  # before anything moves the weights
                    loss.check()
                if config.optim.grad_clip > 0:
                    acc.clip_grad_norm_(setup.model.parameters(), config.optim.grad_clip)
            for opt in setup.optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
        sums = sums + out.sums
    for sched in setup.schedulers:
        sched.step()
    return sums, tokens


class FiniteLoss:
    """Whether a micro-batch's loss is finite, copied to the host without waiting for it: the host
    waits in `check` only for that forward to end (on CUDA, an event recorded after it), which by the
    optimizer step it has, the backward still running; the GPU's queue never runs dry for it."""

    def __init__(self, loss: torch.Tensor, step: int, micro: int, host_batch) -> None:
        self.loss, self.step, self.micro, self.refs = loss.detach(), step, micro, host_batch.refs
        finite = torch.isfinite(self.loss)  # [] bool, on the device
        self.finite = finite.to("cpu", non_blocking=True) if finite.is_cuda else finite
        self.event = torch.cuda.Event() if finite.is_cuda else None
        if self.event is not None:
            self.event.record()

    def check(self) -> None:
        """Stop before a non-finite loss reaches the weights, naming the step and the samples."""
        if self.event is not None:
            self.event.synchronize()
        if not bool(self.finite):
            refs = ", ".join(f"shard {a} sample {b}" for a, b in self.refs.tolist())
            raise TrainingError(
                f"step {self.step + 1}, micro-batch {self.micro}: the loss is {float(self.loss):.4g}, not "
                f"finite; the batch held {refs} (check them with `pipeline verify`; lower --lr, or --resume "
                "from the last step-N)"
            )


class Window:
    """Loss statistics since the last record, summed over ranks when flushed."""

    def __init__(self, setup: Setup, config: TrainConfig) -> None:
        self.setup, self.config = setup, config
        self.sums = zero_sums(setup.drafter_config.block_size, setup.accelerator.device)
        self.tokens, self.t0 = 0, time.perf_counter()
        self.steps, self.sent0 = 0, self.sent()

    def sent(self) -> dict[str, int]:
        """This process's bytes between processes so far: the gradients' all-reduce, Muon's broadcast."""
        muon = [o for o in (getattr(o, "optimizer", o) for o in self.setup.optimizers) if isinstance(o, Muon)]
        return (
            {
                "grad_comm_bytes_per_step": self.setup.grad_comm.bytes,
                "muon_broadcast_bytes_per_step": sum(o.broadcast_bytes for o in muon),
            }
            if self.setup.grad_comm
            else {}
        )

    def add(self, sums: torch.Tensor, tokens: int) -> None:
        self.sums += sums
        self.tokens += tokens
        self.steps += 1

    def flush(self, step: int) -> dict:
        setup, acc = self.setup, self.setup.accelerator
        m = summarize(acc.reduce(self.sums, reduction="sum"))
        tokens = int(acc.reduce(torch.tensor(self.tokens, device=acc.device), reduction="sum"))
        epoch = epochs_at(setup, self.config, step)
        record = {
            "split": "train",
            "step": step,
            "epoch": epoch,
            "lr": setup.schedulers[-1].get_last_lr()[0],
            **({"muon_lr": setup.schedulers[0].get_last_lr()[0]} if len(setup.schedulers) > 1 else {}),
            **m,
            "tokens_per_s": round(tokens / (time.perf_counter() - self.t0), 1),
            "time": time.time(),
            "corrupt_skipped": corrupt_skipped(setup),
        }
        now = self.sent()
        record.update({k: (v - self.sent0[k]) // max(1, self.steps) for k, v in now.items()})
        self.sums.zero_()
        self.tokens, self.t0 = 0, time.perf_counter()
        self.steps, self.sent0 = 0, now
        return record


def corrupt_skipped(setup: Setup) -> int:
    """Samples left out by --on-corrupt skip so far, summed over processes (a collective: every rank calls it)."""
    return int(
        setup.accelerator.reduce(torch.tensor(len(setup.skipped), device=setup.accelerator.device), reduction="sum")
    )


def finish(setup: Setup, config: TrainConfig, metrics: MetricsLog, seen: list) -> dict:
    """Final validation, the last step checkpoint, OUT/final, the curve, audit files."""
    acc, out = setup.accelerator, Path(config.run.out)
    final = {"split": "eval", "step": setup.total_steps, **validate(setup, config)} if setup.eval_refs else None
    if final:
        metrics.write(final)
    if config.run.save_every and setup.total_steps % config.run.save_every:
        save_step(setup, config, setup.total_steps)
    write_drafter(setup, config, out / "final", setup.total_steps)
    if acc.is_main_process:
        try:
            from stages.plots import learning_curve
        except ImportError:  # matplotlib is a dependency, but a bare GPU image may lack it
            learning_curve = None
        if learning_curve is not None:
            learning_curve(
                metrics.path, out / "curve.png", title=f"{config.data.store} shards {setup.train_shards_text}"
            )
    if config.run.audit:
        write_audit(setup, out, seen)
    skipped = corrupt_skipped(setup)
    acc.wait_for_everyone()
    acc.end_training()
    return {
        "out": str(out),
        "steps": setup.total_steps,
        "final_eval": final,
        "world_size": acc.num_processes,
        "main_process": acc.is_main_process,
        "corrupt_skipped": skipped,
        "never_read": never_read(setup, config) if acc.is_main_process else "",
    }


def never_read(setup: Setup, config: TrainConfig) -> str:
    """The shards of --shards no epoch the run read from trains on, and why (--follow, --shard-schedule)."""
    acc = setup.accelerator
    micro = (setup.total_steps - setup.start_step) * config.optim.grad_accum
    last = last_epoch_read(
        config.data, setup.schedule.refs, setup.position, micro, acc.num_processes, setup.local_processes
    )
    return setup.schedule.unread(last)


def done_line(summary: dict) -> str:
    """The last line a run prints: steps, where the drafter is, the held-out figures."""
    ev = summary["final_eval"]
    return (
        f"done: {summary['steps']} steps, checkpoint {summary['out']}/final"
        + (f"; held-out loss {ev['loss']:.4f}, streak tau {ev['tau_streak']:.3f}" if ev else "")
        + (f", replay tau {ev['tau_replay']:.3f} ({ev['replay_prompts']} prompts)" if ev and "tau_replay" in ev else "")
        + (
            f"; {summary['corrupt_skipped']} corrupt sample(s) left out (--on-corrupt skip; run `pipeline verify`)"
            if summary.get("corrupt_skipped")
            else ""
        )
        + (f"; {summary['never_read']}" if summary.get("never_read") else "")
    )


def micro_batches(setup: Setup, config: DataConfig, log=None):
    """This rank's micro-batches from the run's position on (stages/train/position.py), through the
    epochs, read by one loader's worker processes for the whole run (their shard readers kept)."""
    acc = setup.accelerator

    def every_epoch():  # each epoch's shards are decided as its first batch is asked for (--follow)
        epoch = setup.position.epoch
        while True:
            setup.schedule.decide(epoch, acc)
            yield from rank_batches(
                config,
                setup.schedule.refs(epoch),
                setup.position,
                epoch,
                acc.process_index,
                acc.num_processes,
                setup.local_processes,
            )
            epoch += 1

    yield from loader(
        config,
        every_epoch(),
        acc.device.type == "cuda",
        setup.skipped,
        log,
        store=setup.store,
        node_cache=setup.node_cache,
        final_state=setup.plan.soft != "none",
    )
