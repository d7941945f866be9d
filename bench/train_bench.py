"""Stage-two training benchmark on CPU for the tiny drafter (a measurement, not a test).

    python bench/train_bench.py --store /tmp/full.zarr --shards 0-15 --steps 20 --repeat 3

STORE is a store of the shipped tiny target; `pipeline extract --shards 0-63` makes one (the
default --store is hs.zarr, as for `pipeline extract`).

Each repeat builds a fresh run with `stages.train.setup.prepare` (the drafter, AdamW, the schedule,
the Accelerator and the intra-op thread count that `python train.py` gets) and calls
`stages.train.run.train_step` on micro-batches from `stages.train.run.micro_batches` (the same DataLoader
and worker processes). It skips --warmup steps (worker start-up, first allocations), then times
--steps steps, split into the wait for the next batch, the forward (anchor/block/mask preparation,
the drafter, the loss), backward and the optimizer; the split comes from timing wrappers put around
those calls for the run and removed after. No evaluation, checkpoint or metrics file is written.

Then it reads the same batches, in the same order, through a fresh loader with the same worker count
and nothing else running: the loader's batches/s over the steps/s (times --grad-accum) is the data
path's headroom; above 1 the loader is not the bottleneck. It also times building one batch in the
main process (the work each worker does per batch).

The step time grows with the batch's longest sequence (more anchors, longer context), so the
figures depend on the batches the timed steps draw; every repeat draws the same ones (same seed).
Reports medians over the repeats, the peak resident memory (ru_maxrss of this process, and of the
largest loader worker, which counts pages shared with this process by fork), the share of the CPUs
other programs used meanwhile (the machine may be shared), and writes the raw figures as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import stages.train.run as T  # noqa: E402
import stages.train.step as step_module  # noqa: E402
from pipeline.drafter import masks  # noqa: E402
from stages.train.config import TrainConfig  # noqa: E402
from stages.train.data import StoreBatches, train_batches  # noqa: E402
from stages.train.setup import prepare  # noqa: E402
from store.ranges import parse_ranges  # noqa: E402

STEP_PARTS = ("data_wait", "fwd_prep", "fwd_model", "fwd_loss", "backward", "optimizer")


def rss_mib(who=resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # KiB on Linux


def cpu_busy_s() -> tuple[float, float]:
    """(CPU seconds the whole machine has used, and this process with its reaped children): the
    difference over a repeat is what other programs took meanwhile."""
    with open("/proc/stat") as fh:
        f = [int(x) for x in fh.readline().split()[1:]]
    machine = (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait
    ours = sum(getattr(resource.getrusage(w), k) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for k in ("ru_utime", "ru_stime"))
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
    targets = [(step_module, "sample_anchors", "fwd_prep"), (step_module, "make_blocks", "fwd_prep"),
               (masks, "build", "fwd_prep"), (step_module, "dflash_loss", "fwd_loss"), (s.accelerator, "backward", "backward"),
               (s.accelerator, "clip_grad_norm_", "optimizer"),
               *[(opt, attr, "optimizer") for opt in s.optimizers for attr in ("step", "zero_grad")]]
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
    batches = TimedBatches(T.micro_batches(s, config), clock)
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
                    seqs += len(b.lengths) * config.grad_accum  # exact with --grad-accum 1
                    losses.append(float(sums[0] / sums[1]))
    finally:
        clock.on = False
        batches.it.close()  # shuts the loader's workers down
    t = clock.t
    wall = sum(x[2] for x in per_step)
    t["fwd_model"] = wall - sum(t.get(k, 0.0) for k in STEP_PARTS if k != "fwd_model")  # the rest of the step
    r = {"steps": steps, "wall_s": wall, "steps_per_s": steps / wall, "tokens": tokens, "tokens_per_s": tokens / wall,
         "sequences_per_s": seqs / wall, "padding_share": 1 - tokens / padded if config.grad_accum == 1 else None,
         "first_loss": losses[0], "last_loss": losses[-1], "slowest_step_s": max(x[2] for x in per_step),
         "median_step_s": statistics.median(x[2] for x in per_step)}
    r.update({f"{k}_s": t.get(k, 0.0) for k in STEP_PARTS})
    r.update({f"{k}_share": t.get(k, 0.0) / wall for k in STEP_PARTS})
    r["per_step"] = per_step
    return r


def loader_alone(s, config, n: int) -> dict:
    """The same n micro-batches through a fresh stages.train.micro_batches loader, nothing else running."""
    batches = T.micro_batches(s, config)
    try:
        t0 = time.perf_counter()
        next(batches)
        t1 = time.perf_counter()
        for _ in range(n - 1):
            next(batches)
        t2 = time.perf_counter()
    finally:
        batches.close()
    return {"loader_first_batch_s": t1 - t0, "loader_batches": n,
            "loader_batches_per_s": (n - 1) / (t2 - t1) if n > 1 else float("nan")}


def build_in_process(s, config, n: int) -> dict:
    """What a worker spends per batch: StoreBatches[i] in this process, its shard readers opened first."""
    mine = train_batches(config, s.train_refs, 0)[:n]
    ds = StoreBatches(config.store, mine)
    for b in mine:
        for row in b:
            for r in row:
                ds.reader(r.shard)
    t = time.perf_counter()
    for i in range(len(ds)):
        ds[i]
    return {"build_batch_ms": (time.perf_counter() - t) / len(ds) * 1e3}


def one_repeat(args) -> tuple[dict, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        config = TrainConfig(store=args.store, out=str(Path(tmp) / "run"), shards=args.shards,
                               max_steps=args.warmup + args.steps, batch_size=args.batch_size,
                               grad_accum=args.grad_accum, anchors=args.anchors, max_length=args.max_length,
                               num_layers=args.num_layers, workers=args.workers, threads=args.threads,
                               seed=args.seed)
        t = time.perf_counter()
        s = prepare(config, log=lambda m: None)
        res = {"prepare_s": time.perf_counter() - t}
        clock = Clock(s.accelerator.device.type == "cuda")
        res.update(train_steps(s, config, clock, args.warmup, args.steps))
        n = (args.warmup + args.steps) * args.grad_accum
        res.update(loader_alone(s, config, n))
        res["loader_over_step_ratio"] = res["loader_batches_per_s"] / (res["steps_per_s"] * args.grad_accum)
        res.update(build_in_process(s, config, min(n, s.micro_per_epoch)))
        info = {"device": str(s.accelerator.device), "torch_threads": torch.get_num_threads(),
                "params": sum(p.numel() for p in s.raw.parameters()), "train_samples": len(s.train_refs),
                "train_tokens": sum(x.length for x in s.train_refs), "micro_per_epoch": s.micro_per_epoch,
                "drafter": {k: getattr(s.drafter_config, k) for k in (
                    "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "intermediate_size", "vocab_size", "block_size")}}
        s.accelerator.end_training()
        return res, info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", default="hs.zarr", help="store of the tiny target (pipeline extract --shards 0-63)")
    p.add_argument("--shards", default="0-15", help="training shards")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per repeat")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument("--num-layers", type=int, default=None, help="drafter layers (default: 5)")
    p.add_argument("--workers", type=int, default=2, help="data loader worker processes")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads, as train.py --threads (default: $OMP_NUM_THREADS, else cores / processes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=str(ROOT / "bench/results/train_cpu.json"),
                   help="write the raw figures here ('' for none)")
    args = p.parse_args()
    parse_ranges(args.shards)  # a bad range fails before any work
    rss_start = rss_mib()
    runs, info = [], None
    for r in range(args.repeat):
        (m0, o0), t0 = cpu_busy_s(), time.perf_counter()
        res, info = one_repeat(args)
        (m1, o1), t1 = cpu_busy_s(), time.perf_counter()
        res["foreign_cpu_share"] = max(0.0, (m1 - m0) - (o1 - o0)) / ((t1 - t0) * (os.cpu_count() or 1))
        res["rss_peak_so_far_mib"] = rss_mib()
        runs.append(res)
        print(f"repeat {r + 1}/{args.repeat}: {res['steps_per_s']:.2f} steps/s, {res['tokens_per_s']:.0f} tokens/s, "
              f"loader {res['loader_batches_per_s']:.1f} batches/s (x{res['loader_over_step_ratio']:.0f}), data wait "
              f"{res['data_wait_share']:.2%}; other programs used {res['foreign_cpu_share']:.0%} of the CPUs",
              file=sys.stderr, flush=True)
    med = {k: statistics.median(x[k] for x in runs) for k in runs[0] if isinstance(runs[0][k], (int, float))}
    memory = {"rss_after_imports_mib": rss_start, "rss_peak_mib": rss_mib(),
              "rss_peak_worker_mib": rss_mib(resource.RUSAGE_CHILDREN)}
    cmd = "python bench/train_bench.py " + " ".join(sys.argv[1:])
    print(f"# training benchmark: {cmd}\n\n{os.cpu_count()} CPUs, torch {torch.__version__}, {info['torch_threads']} "
          f"intra-op thread(s), {args.workers} loader workers, device {info['device']}; drafter "
          f"{info['params'] / 1e6:.2f}M parameters ({info['drafter']['num_hidden_layers']} layers); "
          f"{info['train_samples']} samples, {info['train_tokens']} tokens in shards {args.shards}; batch "
          f"{args.batch_size} x accum {args.grad_accum}, anchors {args.anchors}; {args.steps} timed steps after "
          f"{args.warmup}, {args.repeat} repeats\n")
    print("| figure | median | runs |\n| --- | --- | --- |")
    for k in ("steps_per_s", "tokens_per_s", "sequences_per_s", "median_step_s", "slowest_step_s",
              "loader_batches_per_s", "loader_over_step_ratio", "build_batch_ms", "loader_first_batch_s",
              *(f"{x}_share" for x in STEP_PARTS), "padding_share", "prepare_s", "first_loss", "last_loss",
              "foreign_cpu_share"):
        if med.get(k) is not None:
            print(f"| {k} | {med[k]:.4g} | {', '.join(f'{x[k]:.4g}' for x in runs)} |")
    print(f"\npeak RSS: {memory['rss_peak_mib']:.0f} MiB ({memory['rss_after_imports_mib']:.0f} MiB after imports); "
          f"largest loader worker {memory['rss_peak_worker_mib']:.0f} MiB (pages shared with the parent included)")
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"command": cmd, "args": vars(args), "machine": {
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}, "info": info, "memory": memory, "runs": runs,
            "median": med}, indent=1) + "\n")


if __name__ == "__main__":
    main()
