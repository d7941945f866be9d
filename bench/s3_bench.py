"""Reading a store through a real S3 API (moto's server, tools/s3/, behind bench/latency_proxy.py
where a per-request latency counts): sample reads (`reads`), training's start-up (`startup`),
evaluation's start-up (`eval-startup`), the node-local cache (`cache`) and training's steps/s (`train`).

    python -m bench.s3_bench reads --local /work/bench/hs.zarr --shards 0-7 --samples 300 [--json bench/results/s3.json]
    python -m bench.read_bench startup build --store /tmp/s2442.zarr --like hs.zarr --shards 2442
    python -m bench.s3_bench startup --startup /tmp/s2442.zarr [--json out.json]
    python -m bench.s3_bench eval-startup --local /tmp/s2442.zarr --delay-ms 50 --prompts 2000 \\
        [--old-shards 40] [--code DIR] [--json bench/results/eval_startup_s3.json]
    python -m bench.s3_bench cache --tiny tiny.zarr --wide /tmp/wide16.zarr [--json bench/results/node_cache.json]
    pipeline extract --store /tmp/t32.zarr --shards 0-31          # the tiny target, 320 prompts
    python -m bench.s3_bench train --store /tmp/t32.zarr [--json bench/results/s3_train.json]

Each starts moto's S3 server on 127.0.0.1 (tests/s3.py; its venv is built once) and copies the store
into s3://bench/. moto serves from memory on the same 2 cores as the client: the figures say what
the client code costs per request and how many requests it makes (requests and bytes are exact),
not a real object store's bandwidth.

`reads` copies the root and --shards of --local, then reads the same --samples random samples (fixed
seed, one ShardReader per shard as a loader worker keeps them) from each, one thread: samples/s, MB/s
of states and the server's request count.

`startup` copies a many-shard store (read_bench startup build) and times train.py's setup on it
through S3 (read_bench's rank child, one rank), the first launch (which builds the index file) and
the next (which reads it), with the requests each made; then the same on the local store.

`eval-startup` copies --local, builds its index file once (a training launch does that), then,
through the latency proxy at --delay-ms, times in this process:
- index: `index_file.load` alone (a listing of `_commits/` and one file);
- start-up: what evaluate.py does before its first replayed round on every committed shard (no
  held-out shards recorded, train.py's default): the root and embeddings, the index, the shard
  choice, the seeded sample of --prompts prompts, the first sample read, and one round of a random
  drafter on it (stages/evaluate);
- before: the per-shard opening an evaluator without the index does (a ShardReader a shard, its
  offsets and prompt lengths), on --old-shards shards, and that time scaled to all shards;
- phases: opening, phase by phase (the root attributes, the embeddings, a shard reader opened with
  its commit record as evaluation opens it, its first sample, a second sample, a reader opened
  without its record as training opens it), each its requests, HEADs and seconds.
Each with the requests it made. `--code DIR` runs it all on another checkout's store and stage code
(`git archive COMMIT | tar -x -C DIR`), for before/after figures from one bench.

`cache` reads two epochs of samples with and without the node-local cache (store/io/node_cache.py,
train.py --cache-dir) at 27B width, through the proxy at 50 ms: requests and bytes fetched, and
samples/s of one loader worker in each epoch. --tiny: a store whose root (attributes, embedding) the
synthetic shards are written under (the shipped tiny target's, `pipeline extract --shards 0-7`);
--wide: the synthetic store, built when absent (--shards shards of 4 samples of ~1,950 tokens,
hidden 5120, 2 taps, random bf16). For each mode a child process (one worker) reads every sample in
batches of 4, its readers kept, epoch 2 in another order; with the cache, a second child (another
process of the node) then reads epoch 3 through the same cache directory with readers of its own.
Seconds: the median of --repeat rounds.

`train` runs train.py --steps steps in the README's setting (4 rows of 64 anchors, 2 loader workers,
one thread) at each --delays latency, each run reading the store through a fresh proxy that counts
its requests. Each run's s/step is the median over its metrics records after the first (start-up,
first reads, loader warm-up), so steady training is compared; the requests are the run's total.
Issue 38's goal: with the latency at which serial reads would take ~3x the step (300 ms at the tiny
width), at least 0.8x the steps/s of the run without it.

--toy: `cache` builds its synthetic samples of ~200 tokens; the rest take their sizes from the flags (TOY).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import harness

TOY = [
    ["reads", "--local", "{store}", "--shards", "0-3", "--samples", "20"],
    ["startup", "--startup", "{store}", "--eval-shards", "3"],
    ["eval-startup", "--local", "{store}", "--delay-ms", "5", "--prompts", "4", "--old-shards", "2"],
    ["cache", "--tiny", "{store}", "--wide", "{tmp}/wide.zarr", "--shards", "1", "--repeat", "1"],
    ["train", "--store", "{store}", "--steps", "10", "--delays", "0,20"],
]
CACHE_DELAY_MS, BATCH = 50, 4
WIDE_SAMPLES, WIDE_TAPS, WIDE_H, WIDE_TOKENS = 4, 2, 5120, 1950
SETTING = [
    "--batch-size",
    "4",
    "--anchors",
    "64",
    "--threads",
    "1",
    "--workers",
    "2",
    "--log-every",
    "5",
    "--save-every",
    "0",
    "--eval-replay-prompts",
    "0",
]


def upload(local: str, url: str, shards: list[int] | None) -> float:
    """Copy the store's root files and the given shards (None: all) -> seconds."""
    import fsspec

    from store.format import layout

    fs = fsspec.filesystem("s3")
    t = time.perf_counter()
    base = Path(local)
    keep = None if shards is None else {layout.shard_group(s) for s in shards} | {layout.commit_key(s) for s in shards}
    files = []
    for p in base.rglob("*"):
        if not p.is_file():
            continue
        key = p.relative_to(base).as_posix()
        if (
            keep is not None
            and key.startswith(("shards/", "_commits/"))
            and not any(key == k or key.startswith(k + "/") for k in keep)
            and key != layout.commit_key("root")
        ):
            continue
        if key.startswith(("_locks/", "_index/")):  # no lock, and no index file: the first launch builds it
            continue
        files.append((str(p), f"{url}/{key}"))
    fs.put([a for a, _ in files], [b for _, b in files])
    return time.perf_counter() - t


@contextlib.contextmanager
def moto(local: str | None = None, name: str = "hs", shards: list[int] | None = None):
    """moto's server for this process and its children, with `local` copied to s3://bench/NAME.zarr:
    yields (server, url, seconds the copy took, a scratch directory)."""
    from tests.s3 import serving

    url = f"s3://bench/{name}.zarr"
    with (
        tempfile.TemporaryDirectory() as tmp,
        serving(Path(os.environ.get("MOTO_LOG_DIR", tmp)) / "moto.log", "bench") as server,
    ):
        seconds = upload(local, url, shards) if local else 0.0
        yield server, url, seconds, Path(tmp)


@contextlib.contextmanager
def proxied(server, delay_ms: float):
    """The latency proxy in front of the server: yields it and the environment a client process
    needs to read through it."""
    from bench.latency_proxy import LatencyProxy

    proxy = LatencyProxy(server.url, delay_ms / 1000).start()
    try:
        yield (
            proxy,
            {
                **server.env,
                "FSSPEC_S3_ENDPOINT_URL": proxy.url,
                "PYTHONPATH": str(harness.REPO),
                "OMP_NUM_THREADS": "1",
            },
        )
    finally:
        proxy.stop()


def output_of(argv: list[str], env: dict, **kw) -> str:
    """Run argv to its end with env added: its standard output (its error if it failed)."""
    p = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, **kw)
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    return p.stdout


# reads


def read_samples(location: str, shards: list[int], n: int) -> dict:
    import numpy as np

    from stages.train.samples import index_samples
    from store.hidden_store import HiddenStore
    from store.shard_reader import ShardReader

    store = HiddenStore(location)
    refs = index_samples(store, shards, 1 << 30)
    picks = np.random.default_rng(0).choice(len(refs), min(n, len(refs)), replace=False)
    readers, nbytes = {}, [0]

    def read():
        for k in picks:
            r = refs[k]
            reader = readers.get(r.shard) or readers.setdefault(r.shard, ShardReader(store, r.shard))
            nbytes[0] += reader[r.index].hidden.numel() * 2

    s = harness.medians(read, 1)["median_s"]  # one pass: a second would read from open readers
    return {
        "samples": len(picks),
        "s": round(s, 2),
        "samples_per_s": round(len(picks) / s, 1),
        "mb_per_s": round(nbytes[0] / s / 1e6, 1),
    }


def run_reads(args) -> dict:
    from store.format.ranges import parse_ranges

    shards = parse_ranges(args.shards, 1 << 20)
    with moto(args.local, shards=shards) as (server, url, seconds, _):
        out = {"upload_s": round(seconds, 1), "local": read_samples(args.local, shards, args.samples)}
        before = server.requests()
        out["s3"] = {**read_samples(url, shards, args.samples), "requests": server.requests() - before}
    return out


def run_startup(args) -> dict:
    from bench.read_bench import time_ranks
    from store import index_file

    out = {}
    with moto(args.startup, "many") as (server, url, seconds, _):
        out["startup_upload_s"] = round(seconds, 1)
        for launch in ("first", "next"):  # the first launch builds the index file, the next reads it
            before = server.requests()
            out[f"startup_s3_{launch}"] = {
                **time_ranks(url, 1, args.eval_shards)[0],
                "requests": server.requests() - before,
            }
    shutil.rmtree(Path(args.startup) / index_file.FOLDER, ignore_errors=True)
    for launch in ("first", "next"):
        out[f"startup_local_{launch}"] = time_ranks(args.startup, 1, args.eval_shards)[0]
    return out


# eval-startup


def fresh_fs() -> None:
    """Forget s3fs's cached instances and listings, as a new process would start."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def counted(proxy, fn) -> dict:
    fresh_fs()
    r0, _ = proxy.counts()
    held = {}
    s = harness.medians(lambda: held.update(extra=fn() or {}), 1)["median_s"]  # one cold run
    return {"s": round(s, 2), "requests": proxy.counts()[0] - r0, **held["extra"]}


def index_only(url: str) -> dict:
    from store import index_file
    from store.hidden_store import HiddenStore

    index, where = index_file.load(HiddenStore(url))
    assert "read from" in where, where  # the file, not a build
    return {"shards": len(index.records)}


def start_up(url: str, prompts: int) -> dict:
    """evaluate.py's path to its first round (stages/evaluate/run.py), with a random drafter."""
    import torch

    from pipeline.decode.batch_replay import BatchReplay
    from pipeline.drafter.model import Drafter
    from stages.evaluate.config import EvalConfig
    from stages.evaluate.prompts import Prompts
    from stages.evaluate.run import _index
    from stages.evaluate.shards import choose_shards
    from stages.train.config import TrainConfig
    from stages.train.setup import drafter_config
    from store.hidden_store import HiddenStore

    store = HiddenStore(url)
    config = EvalConfig(store=url, checkpoints=("random",), max_prompts=prompts)
    index = _index(store)
    shards = choose_shards(config, store, [], [], index.records or None)
    sample = Prompts(store, shards.ids, config.max_prompts, config.seed, index)
    embed, lm_head = store.embedding("embed_tokens"), store.embedding("lm_head")
    dc, _ = drafter_config(TrainConfig.of(num_layers=1), store.attrs, None)
    m = Drafter(dc, embed, lm_head)
    m.init_weights(torch.Generator().manual_seed(0))
    engine = BatchReplay(m.eval(), (), 1, sample.max_length, max_rounds=1)
    with torch.no_grad():
        first = next(engine.run(sample.read(sample.part(0, 1))))
    return {"shards": len(shards.ids), "prompts": len(sample), "first_prompt": [first.shard, first.index]}


def phases(url: str, proxy) -> dict:
    """Opening on the object store, phase by phase, from a fresh handle: each phase's seconds,
    requests (HEADs among them) and seconds over the per-request delay (rounds waited in turn)."""
    from store import index_file
    from store.hidden_store import HiddenStore
    from store.shard_reader import ShardReader

    fresh_fs()
    store, out, held = HiddenStore(url), {}, {}
    out["client"] = {"s": round(harness.medians(store.fs.connect, 1)["median_s"], 3)}  # s3fs's set-up, no request

    def phase(name: str, fn) -> None:
        r0, heads = proxy.counts()[0], proxy.by_method["HEAD"]
        s = harness.medians(fn, 1)["median_s"]
        out[name] = {
            "s": round(s, 3),
            "requests": proxy.counts()[0] - r0,
            "head": proxy.by_method["HEAD"] - heads,
            "rounds": round(s / proxy.delay_s, 1),
        }

    phase("attrs", lambda: store.attrs)
    names = ("embed_tokens", "lm_head")
    phase(
        "embeddings",
        lambda: store.embeddings(names) if hasattr(store, "embeddings") else [store.embedding(n) for n in names],
    )
    phase("index_file", lambda: held.update(index=index_file.load(store)[0]))
    record = held["index"].records[0]
    phase("reader_open", lambda: held.update(reader=ShardReader(store, 0, record)))
    phase("first_sample", lambda: held["reader"][1])
    phase("second_sample", lambda: held["reader"][2])
    phase("reader_open_without_record", lambda: held.update(other=ShardReader(store, 1)))
    out["reader_open_and_first_sample_s"] = round(out["reader_open"]["s"] + out["first_sample"]["s"], 3)
    return out


def before(url: str, shards: int) -> dict:
    """An evaluator's opening of each chosen shard without the index, on the first `shards`."""
    from store.hidden_store import HiddenStore
    from store.shard_reader import ShardReader

    store = HiddenStore(url)
    for s in range(shards):
        reader = ShardReader(store, s)
        reader.offsets, reader.prompt_lens
    return {"shards": shards}


def on_code(code: Path) -> dict:
    """This command run again on another checkout's code: that checkout first on the path (its
    store/, stages/, pipeline/), this one after it (bench/harness.py), this file run by path."""
    argv = sys.argv[1:]
    at = argv.index("--code")
    del argv[at : at + 2]
    script = (
        "import runpy, sys; sys.argv = [sys.argv[1]] + sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    env = {"PYTHONPATH": f"{code.resolve()}{os.pathsep}{harness.REPO}"}
    return json.loads(output_of(harness.python("-P", "-c", script, __file__, *argv), env, cwd=code))


def run_eval_startup(args) -> dict:
    if args.code:
        return on_code(args.code)
    import fsspec.config

    from store import index_file
    from store.hidden_store import HiddenStore

    out = {"delay_ms": args.delay_ms}
    with moto(args.local) as (server, url, seconds, _):
        out["upload_s"] = round(seconds, 1)
        out["index_build_s"] = round(harness.medians(lambda: index_file.load(HiddenStore(url)), 1)["median_s"], 1)
        with proxied(server, args.delay_ms) as (proxy, _):
            fsspec.config.conf["s3"]["endpoint_url"] = proxy.url
            out["index"] = counted(proxy, lambda: index_only(url))
            out["phases"] = phases(url, proxy)
            out["start_up"] = counted(proxy, lambda: start_up(url, args.prompts))
            old = counted(proxy, lambda: before(url, args.old_shards))
    n = out["index"]["shards"]
    out["before"] = {
        **old,
        "scaled_to_all_shards_s": round(old["s"] * n / args.old_shards, 1),
        "scaled_requests": round(old["requests"] * n / args.old_shards),
    }
    out["start_up_over_index"] = round(out["start_up"]["s"] / out["index"]["s"], 2)
    return out


# cache


def build_wide(path: Path, like: Path, shards: int, tokens: int = WIDE_TOKENS, shard_tokens: int = 4096) -> None:
    """Synthetic 27B-width shards (random bf16 states) on the tiny store's root."""
    import torch

    from store.format import layout
    from store.shard_writer import ShardWriter
    from store.store_writer import StoreWriter

    path.mkdir(parents=True)
    for name in ("zarr.json", "target"):
        (shutil.copytree if (like / name).is_dir() else shutil.copy)(like / name, path / name)
    (path / "_commits").mkdir()
    shutil.copy(like / layout.commit_key("root"), path / layout.commit_key("root"))
    store = StoreWriter(str(path))
    g = torch.Generator().manual_seed(0)
    for shard in range(shards):
        w = ShardWriter(store, shard, WIDE_TAPS, WIDE_H, chunk_tokens=256, shard_tokens=shard_tokens)
        for i in range(WIDE_SAMPLES):
            n = tokens + int(torch.randint(-tokens // 10, tokens // 10, (1,), generator=g))
            w.add(i, [1] * 50, [2] * (n - 50), truncated=False)
            w.add_hidden(torch.randn(n, WIDE_TAPS, WIDE_H, generator=g).to(torch.bfloat16))
        w.commit(None, run={})


def cache_child(location: str, cache_dir: str | None, epochs: int, counts_url: str) -> list[dict]:
    """Read every sample of the store `epochs` times (orders fixed by seed), readers kept: per epoch
    its requests, bytes and seconds."""
    import urllib.request

    import numpy as np

    from store.hidden_store import HiddenStore
    from store.io.node_cache import NodeCache
    from store.shard_reader import ShardReader, read_samples

    counts = lambda: json.loads(urllib.request.urlopen(counts_url).read())  # noqa: E731
    store = HiddenStore(location, node_cache=None if cache_dir is None else NodeCache(cache_dir, 1 << 40))
    readers = {shard: ShardReader(store, shard) for shard in sorted(store.committed())}
    refs = [(s, i) for s, r in readers.items() for i in range(len(r))]
    rng = np.random.default_rng(len(os.path.basename(cache_dir or "")) + epochs)
    out = []
    for _ in range(epochs):
        order = [refs[k] for k in rng.permutation(len(refs))]

        def epoch():
            for lo in range(0, len(order), BATCH):
                got = read_samples([(readers[s], i, None, None) for s, i in order[lo : lo + BATCH]])
                assert all(not isinstance(x, Exception) for x in got), got

        before = counts()
        s = harness.medians(epoch, 1)["median_s"]  # one epoch: a second would be the next epoch
        after = counts()
        out.append(
            {
                "samples": len(order),
                "s": round(s, 3),
                "requests": after["requests"] - before["requests"],
                "bytes": after["bytes"] - before["bytes"],
            }
        )
    return out


def cache_epochs(server, url: str, cache_dir: str | None, epochs: int) -> list[dict]:
    with proxied(server, CACHE_DELAY_MS) as (proxy, env):
        argv = harness.python(
            "-m",
            "bench.s3_bench",
            "cache-child",
            url,
            "--epochs",
            str(epochs),
            "--counts",
            f"{proxy.url}/__counts__",
            *(["--cache-dir", cache_dir] if cache_dir else []),
        )
        return json.loads(output_of(argv, env, cwd=harness.REPO).strip().splitlines()[-1])


def figures(epoch: dict, used: int) -> dict:
    return {
        **epoch,
        "requests_per_sample": round(epoch["requests"] / epoch["samples"], 2),
        "fetched_per_used": round(epoch["bytes"] / used, 3),
        "samples_per_s": round(epoch["samples"] / epoch["s"], 2),
    }


def used_bytes(local: Path) -> int:
    """Bytes on disk of every sample's states, tokens and loss mask (what reading all samples uses)."""
    from store.hidden_store import HiddenStore

    store = HiddenStore(str(local))
    return sum(
        n
        for shard in store.committed()
        for f, n in store._file_sizes(f"shards/{shard:05d}").items()
        if f.split("/")[0] in ("hidden", "tokens", "loss_mask") and not f.endswith("zarr.json")
    )


def cache_round(wide: Path, used: int) -> dict:
    """One round: moto started, the store uploaded, each mode's children run."""
    out = {}
    with moto(str(wide), "wide") as (server, url, _, tmp):
        for k, e in enumerate(cache_epochs(server, url, None, 2)):
            out[f"no_cache_epoch{k + 1}"] = figures(e, used)
        cache = str(tmp / "cache")
        for k, e in enumerate(cache_epochs(server, url, cache, 2)):
            out[f"cache_epoch{k + 1}"] = figures(e, used)
        out["cache_epoch3_other_process"] = figures(cache_epochs(server, url, cache, 1)[0], used)
        out["cache_bytes_on_disk"] = sum(
            f.stat().st_size for f in Path(cache).rglob("*") if f.is_file() and not f.name.startswith("index.sqlite")
        )
    return out


def run_cache(args) -> dict:
    if not args.wide.exists():
        build_wide(args.wide, args.tiny, args.shards, 200 if args.toy else WIDE_TOKENS)
    used = used_bytes(args.wide)
    runs = [cache_round(args.wide, used) for _ in range(args.repeat)]
    out = {"delay_ms": CACHE_DELAY_MS, "batch": BATCH, "used_bytes": used, "repeats": args.repeat, **runs[0]}
    for key, first in runs[0].items():  # requests and bytes are the same every time; seconds: the median
        if isinstance(first, dict):
            out[key] = figures({**first, "s": harness.median_of(r[key]["s"] for r in runs)}, used)
    return out


# train


def train_run(url: str, out: Path, steps: int, delay_ms: int, server, extra: list[str]) -> dict:
    with proxied(server, delay_ms) as (proxy, env):
        p = subprocess.run(
            harness.python("train.py", "--store", url, "--out", str(out), "--max-steps", str(steps), *SETTING, *extra),
            cwd=harness.REPO,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
        )
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["time"] for r in recs if r["split"] == "train"]
    per_step = [(b - a) / 5 for a, b in zip(times, times[1:])]  # --log-every 5
    return {
        "delay_ms": delay_ms,
        "steps": steps,
        "s_per_step": round(harness.median_of(per_step), 3),
        "s_per_step_windows": [round(x, 3) for x in per_step],
        "requests": proxy.requests,
        "requests_per_sample": round(proxy.requests / (steps * 4), 2),
        "bytes": proxy.bytes,
    }


def run_train(args) -> dict:
    rows = []
    with moto(str(args.store), "train") as (server, url, _, tmp):
        for delay in map(int, args.delays.split(",")):
            rows.append(train_run(url, tmp / f"run-{delay}", args.steps, delay, server, args.extra.split()))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    base = rows[0]["s_per_step"]
    return {
        "store": str(args.store),
        "setting": SETTING,
        "extra": args.extra,
        "runs": rows,
        "steps_per_s_ratio": {r["delay_ms"]: round(base / r["s_per_step"], 3) for r in rows},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = harness.subcommand(sub, "reads", "samples/s a loader worker reads from S3 against the local disk")
    r.add_argument("--local", required=True)
    r.add_argument("--shards", default="0-7")
    r.add_argument("--samples", type=int, default=300)
    s = harness.subcommand(sub, "startup", "train.py's setup on a many-shard store through S3, with its requests")
    s.add_argument("--startup", required=True, help="a many-shard store (read_bench startup build)")
    s.add_argument("--eval-shards", default="2400-2441")
    e = harness.subcommand(sub, "eval-startup", "evaluation's start-up through S3 with a per-request latency")
    e.add_argument("--local", required=True, help="a many-shard store (read_bench startup build)")
    e.add_argument("--delay-ms", type=float, default=50.0, help="latency the proxy adds to every request")
    e.add_argument("--prompts", type=int, default=2000, help="evaluate.py's --max-prompts")
    e.add_argument("--old-shards", type=int, default=40, help="shards the per-shard opening is timed on")
    e.add_argument("--code", type=Path, help="run on the code of this checkout instead (before/after figures)")
    c = harness.subcommand(sub, "cache", "two epochs of reads from S3 with and without the node-local cache")
    c.add_argument("--tiny", type=Path, required=True)
    c.add_argument("--wide", type=Path, required=True)
    c.add_argument("--shards", type=int, default=4)
    c.add_argument("--repeat", type=int, default=3, help="rounds; seconds are their median")
    child = sub.add_parser("cache-child")  # internal: one process of `cache`
    child.add_argument("url")
    child.add_argument("--epochs", type=int, required=True)
    child.add_argument("--counts", required=True)
    child.add_argument("--cache-dir")
    t = harness.subcommand(sub, "train", "train.py's steps/s from S3 with a per-request latency against without")
    t.add_argument("--store", type=Path, required=True, help="a local store to copy into moto")
    t.add_argument("--steps", type=int, default=40)
    t.add_argument("--delays", default="0,300", help="latencies per request, ms")
    t.add_argument("--extra", default="", help="more train.py flags, space-separated (e.g. --cache-dir ...)")
    args = harness.parse(p)
    if args.cmd == "cache-child":
        print(json.dumps(cache_child(args.url, args.cache_dir, args.epochs, args.counts)))
        return
    harness.torch_setup(args.threads)
    run = {
        "reads": run_reads,
        "startup": run_startup,
        "eval-startup": run_eval_startup,
        "cache": run_cache,
        "train": run_train,
    }[args.cmd]
    harness.emit(run(args), args)


if __name__ == "__main__":
    main()
