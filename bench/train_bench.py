"""Stage-two training benchmarks (measurements, not tests): speed on CPU, memory against context
length, and the GPU check of the flex kernels and a short bf16 run.

    python -m bench.train_bench speed --store /tmp/full.zarr --shards 0-15 --steps 20 --repeat 3 --threads 2 \\
        [--json bench/results/train_cpu.json]
    python -m bench.train_bench long-context --like hs.zarr --store /tmp/long.zarr --threads 2 \\
        [--lengths 1024,2048,4096,8192] [--json bench/results/long_context_cpu.json]
    python -m bench.train_bench gpu --store /tmp/regen.zarr --run-dir /tmp/gpu_run --json bench/gpu/train.json

`speed`: STORE is a store of the shipped tiny target; `pipeline extract --shards 0-63` makes one (the
default --store is hs.zarr, as for `pipeline extract`). Each repeat runs in a fresh process (its
peak resident memory is the repeat's, harness.in_child) and builds a run with
`stages.train.setup.prepare` (the drafter, AdamW, the schedule, the Accelerator and the intra-op
thread count that `python train.py --threads N` gets) and calls `stages.train.run.train_step` on
micro-batches from `stages.train.run.micro_batches` (the same DataLoader and worker processes). It
skips --warmup steps (worker start-up, first allocations), then times --steps steps, split into the
wait for the next batch, the forward (anchor/block/mask preparation, the drafter, the loss),
backward and the optimizer; the split comes from timing wrappers put around those calls for the run
and removed after. No evaluation, checkpoint or metrics file is written. Then it reads the same
batches, in the same order, through a fresh loader with the same worker count and nothing else
running: the loader's batches/s over the steps/s (times --grad-accum) is the data path's headroom;
above 1 the loader is not the bottleneck. It also times building one batch in the main process (the
work each worker does per batch). The step time grows with the batch's longest sequence, so every
repeat draws the same batches (same seed). Reports medians over the repeats and the share of the
CPUs other programs used meanwhile (the machine may be shared).

`long-context`: builds (once) a store with the root of --like and 8 samples of each length in
--lengths (64 prompt tokens, the rest completion; random tokens and states: memory does not depend
on their values), then for each length, with and without --grad-checkpoint, runs train.py's run
(setup, 3 steps, the validations before the first step and at the end; --max-length that length,
--batch-size 1, --workers 0, the default drafter and 512 anchors) in a fresh process: its peak
resident memory and seconds. The samples of a length are its own shard, trained alone.

`gpu` (CUDA only; bench/gpu_check.sh runs it): 1. flex_attention (compiled, with the BlockMask)
against the block-local SDPA path on one batch of real stored states: drafter output and parameter
gradients, in fp32 and under bf16 autocast. 2. A short bf16 training run through stages.train.run
(flex, fp32 master weights): steps/s, tokens/s, peak GPU memory, and that the loss went down. On a
machine without CUDA it fails, or with --toy prints a "skipped" result.

--toy: `speed` 2 steps of a 1-layer drafter, 32 anchors, one repeat; `long-context` one length (256).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

import stages.train.run as T
import stages.train.step as step_module
from bench import harness
from pipeline.drafter import masks
from stages.train.config import TrainConfig
from stages.train.dataset import StoreBatches
from stages.train.epoch_order import train_batches
from stages.train.setup import prepare
from store.format.ranges import parse_ranges

TOY = [
    ["speed", "--store", "{store}", "--shards", "0-2"],
    ["long-context", "--like", "{store}", "--store", "{tmp}/long.zarr"],
    ["gpu", "--store", "{store}"],
]
PROMPT, SAMPLES = 64, 8
STEP_PARTS = ("data_wait", "fwd_prep", "fwd_model", "fwd_loss", "backward", "optimizer")


def cpu_busy_s() -> tuple[float, float]:
    """(CPU seconds the whole machine has used, and this process with its reaped children): the
    difference over a repeat is what other programs took meanwhile."""
    with open("/proc/stat") as fh:
        f = [int(x) for x in fh.readline().split()[1:]]
    machine = (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait
    ours = sum(
        getattr(resource.getrusage(w), k)
        for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        for k in ("ru_utime", "ru_stime")
    )
    return machine, ours


class Clock:
    """Seconds per phase while `on`; synchronizes CUDA so the split is exact there too."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.on, self.t = cuda, False, {}

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def wrap(self, fn, name: str):
        def timed(*a, **k):
            if not self.on:
                return fn(*a, **k)
            t = self.now()
            try:
                return fn(*a, **k)
            finally:
                self.t[name] = self.t.get(name, 0.0) + self.now() - t

        return timed


@contextlib.contextmanager
def timed_calls(clock: Clock, s):
    """Timing wrappers on what train_step and forward_loss call, restored on exit."""
    targets = [
        (step_module, "sample_anchors", "fwd_prep"),
        (step_module, "make_blocks", "fwd_prep"),
        (masks, "build", "fwd_prep"),
        (step_module, "dflash_loss", "fwd_loss"),
        (s.accelerator, "backward", "backward"),
        (s.accelerator, "clip_grad_norm_", "optimizer"),
        *[(opt, attr, "optimizer") for opt in s.optimizers for attr in ("step", "zero_grad")],
    ]
    saved = []
    for obj, attr, name in targets:
        own = attr in vars(obj)  # module functions are restored; instance shadows are deleted
        saved.append((obj, attr, getattr(obj, attr) if own else None))
        setattr(obj, attr, clock.wrap(getattr(obj, attr), name))
    try:
        yield
    finally:
        for obj, attr, old in reversed(saved):
            if old is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)


class TimedBatches:
    """The micro-batch iterator, timing each next() and recording what it handed out."""

    def __init__(self, it, clock: Clock) -> None:
        self.it, self.clock, self.last = it, clock, None
        self.next = clock.wrap(lambda: next(it), "data_wait")

    def __iter__(self):
        return self

    def __next__(self):
        self.last = self.next()
        return self.last


def train_steps(s, config, clock: Clock, warmup: int, steps: int) -> dict:
    """stages.train.train_step, `warmup` untimed steps then `steps` timed ones."""
    batches = TimedBatches(T.micro_batches(s, config.data), clock)
    per_step = []  # [longest sequence, tokens, seconds] of each timed step
    tokens = seqs = padded = 0
    losses = []
    try:
        with timed_calls(clock, s):
            for step in range(warmup + steps):
                clock.on = step >= warmup
                t0 = clock.now()
                sums, n = T.train_step(s, config, batches, step, None)
                dt = clock.now() - t0
                if clock.on:
                    b = batches.last  # with --grad-accum > 1 the step's last micro-batch
                    per_step.append([b.tokens.shape[1], n, round(dt, 4)])
                    tokens, padded = tokens + n, padded + b.tokens.numel()
                    seqs += len(b.lengths) * config.optim.grad_accum  # exact with --grad-accum 1
                    losses.append(float(sums[0] / sums[1]))
    finally:
        clock.on = False
        batches.it.close()  # shuts the loader's workers down
    t = clock.t
    wall = sum(x[2] for x in per_step)
    t["fwd_model"] = wall - sum(t.get(k, 0.0) for k in STEP_PARTS if k != "fwd_model")  # the rest of the step
    r = {
        "steps": steps,
        "wall_s": wall,
        "steps_per_s": steps / wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "sequences_per_s": seqs / wall,
        "padding_share": 1 - tokens / padded if config.optim.grad_accum == 1 else None,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "slowest_step_s": max(x[2] for x in per_step),
        "median_step_s": harness.median_of(x[2] for x in per_step),
    }
    r.update({f"{k}_s": t.get(k, 0.0) for k in STEP_PARTS})
    r.update({f"{k}_share": t.get(k, 0.0) / wall for k in STEP_PARTS})
    r["per_step"] = per_step
    return r


def loader_alone(s, config, n: int) -> dict:
    """The same n micro-batches through a fresh stages.train.micro_batches loader, nothing else running."""
    batches = T.micro_batches(s, config.data)
    try:
        t0 = time.perf_counter()
        next(batches)
        t1 = time.perf_counter()
        for _ in range(n - 1):
            next(batches)
        t2 = time.perf_counter()
    finally:
        batches.close()
    return {
        "loader_first_batch_s": t1 - t0,
        "loader_batches": n,
        "loader_batches_per_s": (n - 1) / (t2 - t1) if n > 1 else float("nan"),
    }


def build_in_process(s, config, n: int) -> dict:
    """What a worker spends per batch: StoreBatches[i] in this process, its shard readers opened first."""
    mine = train_batches(config.data, s.train_refs, 0)[:n]
    ds = StoreBatches(config.data.store, mine)
    for b in mine:
        for row in b:
            for r in row:
                ds.reader(r.shard)
    t = time.perf_counter()
    for i in range(len(ds)):
        ds[i]
    return {"build_batch_ms": (time.perf_counter() - t) / len(ds) * 1e3}


def one_repeat(args) -> tuple[dict, dict]:
    """One repeat of `speed` (run in a fresh process) -> (figures, what ran)."""
    harness.torch_setup(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        config = TrainConfig.of(
            store=args.store,
            out=str(Path(tmp) / "run"),
            shards=args.shards,
            max_steps=args.warmup + args.steps,
            batch_size=args.batch_size,
            grad_accum=args.grad_accum,
            anchors=args.anchors,
            max_length=args.max_length,
            num_layers=args.num_layers,
            workers=args.workers,
            threads=args.threads,
            seed=args.seed,
        )
        t = time.perf_counter()
        s = prepare(config, log=lambda m: None)
        res = {"prepare_s": time.perf_counter() - t}
        clock = Clock(s.accelerator.device.type == "cuda")
        res.update(train_steps(s, config, clock, args.warmup, args.steps))
        n = (args.warmup + args.steps) * args.grad_accum
        res.update(loader_alone(s, config, n))
        res["loader_over_step_ratio"] = res["loader_batches_per_s"] / (res["steps_per_s"] * args.grad_accum)
        res.update(build_in_process(s, config, min(n, s.micro_per_epoch)))
        info = {
            "device": str(s.accelerator.device),
            "torch_threads": torch.get_num_threads(),
            "params": sum(p.numel() for p in s.raw.parameters()),
            "train_samples": len(s.train_refs),
            "train_tokens": sum(x.length for x in s.train_refs),
            "micro_per_epoch": s.micro_per_epoch,
            "drafter": {
                k: getattr(s.drafter_config, k)
                for k in (
                    "num_hidden_layers",
                    "hidden_size",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "head_dim",
                    "intermediate_size",
                    "vocab_size",
                    "block_size",
                )
            },
        }
        s.accelerator.end_training()
        return res, info


def speed(args) -> dict:
    parse_ranges(args.shards)  # a bad range fails before any work
    runs, info = [], None
    for r in range(args.repeat):
        (m0, o0), t0 = cpu_busy_s(), time.perf_counter()
        (res, info), mem = harness.in_child(one_repeat, args)
        (m1, o1), t1 = cpu_busy_s(), time.perf_counter()
        res["foreign_cpu_share"] = max(0.0, (m1 - m0) - (o1 - o0)) / ((t1 - t0) * (os.cpu_count() or 1))
        res["rss_after_imports_mib"], res["rss_peak_mib"] = (
            mem["start_rss_bytes"] / 2**20,
            mem["peak_rss_bytes"] / 2**20,
        )
        runs.append(res)
        print(
            f"repeat {r + 1}/{args.repeat}: {res['steps_per_s']:.2f} steps/s, {res['tokens_per_s']:.0f} tokens/s, "
            f"loader {res['loader_batches_per_s']:.1f} batches/s (x{res['loader_over_step_ratio']:.0f}), data wait "
            f"{res['data_wait_share']:.2%}; other programs used {res['foreign_cpu_share']:.0%} of the CPUs",
            file=sys.stderr,
            flush=True,
        )
    med = {k: harness.median_of(x[k] for x in runs) for k in runs[0] if isinstance(runs[0][k], (int, float))}
    return {
        "command": "python -m bench.train_bench " + " ".join(sys.argv[1:]),
        "args": vars(args),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        },
        "info": info,
        "runs": runs,
        "median": med,
    }


def build_long(location: str, like: str, lengths: list[int]) -> None:
    """A store with the root of `like` and SAMPLES random samples of each length, one shard per length."""
    from pipeline import fingerprint
    from store.format.schema import to_json
    from store.hidden_store import HiddenStore
    from store.shard_writer import ShardWriter
    from store.store_writer import StoreWriter

    src = HiddenStore(like)
    compat = dataclasses.replace(src.attrs.compat, num_shards=len(lengths))
    attrs = dataclasses.replace(
        src.attrs, num_shards=len(lengths), compat=compat, fingerprint=fingerprint.sha256_json(to_json(compat))
    )
    store = StoreWriter(location)
    store.create_or_check(attrs, src.embedding("embed_tokens"), src.embedding("lm_head"))
    g = torch.Generator().manual_seed(0)
    for shard, n in enumerate(lengths):
        if store.commit_record(shard) is not None:
            continue
        w = ShardWriter(
            store,
            shard,
            len(attrs.taps),
            attrs.hidden_size,
            chunk_tokens=attrs.layout.chunk_tokens,
            shard_tokens=attrs.layout.shard_tokens,
        )
        for i in range(SAMPLES):
            ids = torch.randint(5, attrs.vocab_size - 8, (n,), generator=g).tolist()
            w.add(shard * SAMPLES + i, ids[:PROMPT], ids[PROMPT:], truncated=False)
        w.add_hidden(torch.randn(SAMPLES * n, len(attrs.taps), attrs.hidden_size, generator=g).to(torch.bfloat16))
        w.commit(None, run={})


def long_run(store: str, shard: int, length: int, ckpt: bool, threads: int) -> float:
    """train.py's run of 3 steps on one length's shard (in a fresh process) -> seconds."""
    from stages.train.run import run

    with tempfile.TemporaryDirectory() as out:
        config = TrainConfig.of(
            store=store,
            out=f"{out}/run",
            shards=str(shard),
            max_length=length,
            batch_size=1,
            workers=0,
            max_steps=3,
            threads=threads,
            grad_checkpoint=ckpt,
            eval_every=0,
            save_every=0,
            log_every=1,
        )
        t = time.perf_counter()
        run(config, log=lambda m: None)
        return time.perf_counter() - t


def long_context(args) -> dict:
    lengths = [256] if args.toy else [int(x) for x in args.lengths.split(",")]
    build_long(args.store, args.like, lengths)
    rows = []
    for shard, n in enumerate(lengths):
        for ckpt in (False, True):
            seconds, mem = harness.in_child(long_run, args.store, shard, n, ckpt, args.threads)
            rows.append(
                {
                    "max_length": n,
                    "grad_checkpoint": ckpt,
                    "peak_rss_mb": round(mem["peak_rss_bytes"] / 2**20),
                    "run_s": round(seconds, 1),
                }
            )
    return {"samples_per_length": SAMPLES, "threads": args.threads, "rows": rows}


def kernel_agreement(store_path: str, anchors: int, dtype: str) -> dict:
    from pipeline.drafter.blocks import make_blocks, sample_anchors
    from pipeline.drafter.loss import dflash_loss
    from pipeline.drafter.model import Drafter
    from stages.train.samples import index_samples
    from stages.train.setup import drafter_config
    from stages.train.step import pad_for_compile
    from store.hidden_store import HiddenStore

    store = HiddenStore(store_path)
    config = TrainConfig.of(anchors=anchors, layer_types="sliding,sliding,sliding,sliding,full", sliding_window=64)
    dc, _ = drafter_config(config, store.attrs, None)
    dev = torch.device("cuda")
    model = Drafter(
        dc, store.embedding("embed_tokens").to(dev, torch.bfloat16), store.embedding("lm_head").to(dev, torch.bfloat16)
    ).to(dev)
    model.init_weights(torch.Generator().manual_seed(0), std=0.05)
    model.to(dev)
    refs = sorted(index_samples(store, sorted(store.committed())[:2], 1024), key=lambda r: -r.length)[:4]
    batch = StoreBatches(store_path, [[(r,) for r in refs]])[0].to(dev)
    a, v = sample_anchors(batch.loss_mask.cpu(), anchors, torch.Generator().manual_seed(0))
    a, v, S = pad_for_compile(a, v, int(a.max()), anchors)
    a, v = a.to(dev), v.to(dev)
    blk = make_blocks(batch.tokens, batch.loss_mask, a, v, dc.block_size, dc.mask_token_id)
    hidden = torch.nn.functional.pad(batch.hidden, (0, 0, 0, 0, 0, max(0, S - batch.hidden.shape[1])))[:, :S]
    pos = torch.arange(S, device=dev)[None].expand(len(refs), -1)
    out = {}
    for kind in ("local", "flex"):
        model.zero_grad()
        t = time.perf_counter()
        with torch.autocast("cuda", torch.bfloat16, enabled=dtype == "bf16"):
            mk = masks.build(model.rules, a, v, S, dc.block_size, kind)
            h = model(hidden, blk.block_ids, pos, blk.positions, mk)
        loss = dflash_loss(h, blk.labels, model.lm_head, 7.0).loss
        loss.backward()
        torch.cuda.synchronize()
        out[kind] = (
            h.detach().float(),
            {n: p.grad.float() for n, p in model.named_parameters()},
            float(loss),
            time.perf_counter() - t,
        )
    (h0, g0, l0, t0), (h1, g1, l1, t1) = out["local"], out["flex"]
    rel = {n: float((g0[n] - g1[n]).norm() / g0[n].norm().clamp_min(1e-30)) for n in g0}
    return {
        "dtype": dtype,
        "anchors": anchors,
        "context": S,
        "loss_local": l0,
        "loss_flex": l1,
        "output_max_abs_diff": float((h0 - h1).abs().max()),
        "output_scale": float(h0.abs().max()),
        "grad_rel_diff_max": max(rel.values()),
        "grad_rel_diff_worst": max(rel, key=rel.get),
        "seconds_local_first": t0,
        "seconds_flex_first": t1,
    }


def training(store_path: str, steps: int, batch_size: int, anchors: int, run_dir: str | None) -> dict:
    from stages.train.run import run

    out = Path(run_dir) if run_dir else Path(tempfile.mkdtemp()) / "run"
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    summary = run(
        TrainConfig.of(
            store=store_path, out=str(out), max_steps=steps, batch_size=batch_size, anchors=anchors, log_every=10
        ),
        log=lambda m: print(m, file=sys.stderr),
    )
    wall = time.perf_counter() - t
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["split"] == "train"]
    later = train[1:] or train
    return {
        "steps": summary["steps"],
        "wall_s": wall,
        "batch_size": batch_size,
        "anchors": anchors,
        "first_loss": train[0]["loss"],
        "last_loss": train[-1]["loss"],
        "tokens_per_s_median": harness.median_of(r["tokens_per_s"] for r in later),
        "peak_gpu_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def gpu(args) -> dict:
    if not torch.cuda.is_available():
        if args.toy:
            return {"skipped": "no CUDA on this machine"}
        sys.exit("error: `gpu` needs CUDA")
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "kernels": [kernel_agreement(args.store, args.anchors, d) for d in ("fp32", "bf16")],
        "training": training(args.store, args.steps, args.batch_size, args.anchors, args.run_dir),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    subs = p.add_subparsers(dest="cmd", required=True)
    s = harness.subcommand(subs, "speed", "steps/s, tokens/s and their split on CPU; the loader's headroom")
    s.add_argument("--store", default="hs.zarr", help="store of the tiny target (pipeline extract --shards 0-63)")
    s.add_argument("--shards", default="0-15", help="training shards")
    s.add_argument("--steps", type=int, default=20, help="timed optimizer steps per repeat")
    s.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    s.add_argument("--repeat", type=int, default=3)
    s.add_argument("--batch-size", type=int, default=4)
    s.add_argument("--grad-accum", type=int, default=1)
    s.add_argument("--anchors", type=int, default=512)
    s.add_argument("--max-length", type=int, default=4096)
    s.add_argument("--num-layers", type=int, default=None, help="drafter layers (default: 5)")
    s.add_argument("--workers", type=int, default=2, help="data loader worker processes")
    s.add_argument("--seed", type=int, default=0)
    c = harness.subcommand(subs, "long-context", "peak memory against --max-length, with and without --grad-checkpoint")
    c.add_argument("--like", required=True, help="a store of the target whose root (embeddings, taps) to copy")
    c.add_argument("--store", required=True, help="where the store of random samples goes (reused if there)")
    c.add_argument("--lengths", default="1024,2048,4096,8192")
    g = harness.subcommand(subs, "gpu", "flex against block-local SDPA, and a short bf16 run (CUDA)")
    g.add_argument("--store", required=True)
    g.add_argument("--steps", type=int, default=60)
    g.add_argument("--batch-size", type=int, default=8)
    g.add_argument("--anchors", type=int, default=512)
    g.add_argument(
        "--run-dir", default=None, help="where the training run goes (must not hold a run) [default: a temp dir]"
    )
    args = harness.parse(p)
    if args.toy and args.cmd == "speed":
        args.steps, args.warmup, args.repeat, args.anchors, args.num_layers, args.workers = 2, 1, 1, 32, 1, 1
    harness.torch_setup(args.threads)
    harness.emit({"speed": speed, "long-context": long_context, "gpu": gpu}[args.cmd](args), args)


if __name__ == "__main__":
    main()
