"""Evaluation's start-up on an object store at the real job's shard count: seconds from the store
opened to the first replayed round, against what reading the store's index file costs, through
moto's S3 server behind a proxy that adds a fixed latency to every request.

    python bench/startup_bench.py build --store /tmp/s2442.zarr --like hs.zarr --shards 2442
    python bench/eval_startup_bench.py --local /tmp/s2442.zarr --delay-ms 50 --prompts 2000 \\
        [--old-shards 40] [--json bench/results/eval_startup_s3.json]

Copies --local to s3://bench/hs.zarr (straight to moto), builds its index file once (a training
launch does that), then, through tools/s3/latency_proxy.py, times in this process:
- index: `index_file.load` alone (a listing of `_commits/` and one file);
- start-up: what evaluate.py does before its first replayed round on every committed shard (no
  held-out shards recorded, train.py's default): the root and embeddings, the index, the shard
  choice, the seeded sample of --prompts prompts, the first sample read, and one round of a random
  drafter on it (stages/evaluate);
- before: the per-shard opening the evaluator did until this change (a ShardReader a shard, its
  offsets and prompt lengths), on --old-shards shards, and that time scaled to all shards;
- phases: opening, phase by phase (the root attributes, the embeddings, a shard reader opened with
  its commit record as evaluation opens it, its first sample, a second sample, a reader opened
  without its record as training opens it), each its requests, HEADs and seconds.
Each with the requests it made. `--code DIR` runs it all on another checkout's code (the store
code before a change: `git archive COMMIT | tar -x -C DIR`), for before/after figures from one
bench. moto serves from memory on the client's cores: the figures say how
many requests wait in turn, not a real store's bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if "--code" in sys.argv:  # before anything of the project is imported
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--code") + 1]).resolve()))

from bench.s3_bench import upload  # noqa: E402
from tests.s3 import serving  # noqa: E402
from tools.s3.latency_proxy import LatencyProxy  # noqa: E402


def fresh_fs() -> None:
    """Forget s3fs's cached instances and listings, as a new process would start."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def counted(proxy: LatencyProxy, fn) -> dict:
    fresh_fs()
    r0, _ = proxy.counts()
    t = time.perf_counter()
    extra = fn() or {}
    return {"s": round(time.perf_counter() - t, 2), "requests": proxy.counts()[0] - r0, **extra}


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
    from stages.evaluate.conditioning import choose_shards
    from stages.evaluate.config import EvalConfig
    from stages.evaluate.prompts import Prompts
    from stages.evaluate.run import _index
    from stages.train.config import TrainConfig
    from stages.train.setup import drafter_config
    from store.hidden_store import HiddenStore

    store = HiddenStore(url)
    config = EvalConfig(store=url, checkpoints=("random",), max_prompts=prompts)
    index = _index(store)
    shards = choose_shards(config, store, [], [], index.records or None)
    sample = Prompts(store, shards.ids, config.max_prompts, config.seed, index)
    embed, lm_head = store.embedding("embed_tokens"), store.embedding("lm_head")
    dc, _ = drafter_config(TrainConfig(num_layers=1), store.attrs, None)
    m = Drafter(dc, embed, lm_head)
    m.init_weights(torch.Generator().manual_seed(0))
    engine = BatchReplay(m.eval(), (), 1, sample.max_length, max_rounds=1)
    with torch.no_grad():
        first = next(engine.run(sample.read(sample.part(0, 1))))
    return {"shards": len(shards.ids), "prompts": len(sample), "first_prompt": [first.shard, first.index]}


def phases(url: str, proxy: LatencyProxy) -> dict:
    """Opening on the object store, phase by phase, from a fresh handle: each phase's seconds,
    requests (HEADs among them) and seconds over the per-request delay (rounds waited in turn)."""
    from store import index_file
    from store.hidden_store import HiddenStore
    from store.shard_reader import ShardReader

    fresh_fs()
    store, out, held = HiddenStore(url), {}, {}
    phase_s = time.perf_counter()
    store.fs.connect()  # s3fs's client set-up (no request), which the first phase would otherwise carry
    out["client"] = {"s": round(time.perf_counter() - phase_s, 3)}

    def phase(name: str, fn) -> None:
        r0, heads = proxy.counts()[0], proxy.by_method["HEAD"]
        t = time.perf_counter()
        fn()
        s = time.perf_counter() - t
        out[name] = {"s": round(s, 3), "requests": proxy.counts()[0] - r0, "head": proxy.by_method["HEAD"] - heads,
                     "rounds": round(s / proxy.delay_s, 1)}

    phase("attrs", lambda: store.attrs)
    names = ("embed_tokens", "lm_head")
    phase("embeddings", lambda: store.embeddings(names) if hasattr(store, "embeddings")
          else [store.embedding(n) for n in names])
    phase("index_file", lambda: held.update(index=index_file.load(store)[0]))
    record = held["index"].records[0]
    phase("reader_open", lambda: held.update(reader=ShardReader(store, 0, record)))
    phase("first_sample", lambda: held["reader"][1])
    phase("second_sample", lambda: held["reader"][2])
    phase("reader_open_without_record", lambda: held.update(other=ShardReader(store, 1)))
    out["reader_open_and_first_sample_s"] = round(out["reader_open"]["s"] + out["first_sample"]["s"], 3)
    return out


def before(url: str, shards: int) -> dict:
    """The evaluator's opening of each chosen shard until this change, on the first `shards`."""
    from store.hidden_store import HiddenStore
    from store.shard_reader import ShardReader

    store = HiddenStore(url)
    for s in range(shards):
        reader = ShardReader(store, s)
        reader.offsets, reader.prompt_lens
    return {"shards": shards}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local", required=True, help="a many-shard store (bench/startup_bench.py build)")
    p.add_argument("--delay-ms", type=float, default=50.0, help="latency the proxy adds to every request")
    p.add_argument("--prompts", type=int, default=2000, help="evaluate.py's --max-prompts")
    p.add_argument("--old-shards", type=int, default=40, help="shards the per-shard opening is timed on")
    p.add_argument("--json", type=Path)
    p.add_argument("--code", type=Path, help="run on the code of this checkout instead (before/after figures)")
    args = p.parse_args()
    import fsspec.config

    from store import index_file
    from store.hidden_store import HiddenStore

    out = {"delay_ms": args.delay_ms}
    with tempfile.TemporaryDirectory() as tmp, serving(Path(os.environ.get("MOTO_LOG_DIR", tmp)) / "moto.log",
                                                       "bench") as server:
        proxy = None
        try:
            url = "s3://bench/hs.zarr"
            out["upload_s"] = round(upload(args.local, url, None), 1)
            out["index_build_s"] = round(_timed(lambda: index_file.load(HiddenStore(url))), 1)  # as a launch would
            proxy = LatencyProxy(server.url, args.delay_ms / 1000).start()
            fsspec.config.conf["s3"]["endpoint_url"] = proxy.url
            out["index"] = counted(proxy, lambda: index_only(url))
            out["phases"] = phases(url, proxy)
            out["start_up"] = counted(proxy, lambda: start_up(url, args.prompts))
            old = counted(proxy, lambda: before(url, args.old_shards))
            n = out["index"]["shards"]
            out["before"] = {**old, "scaled_to_all_shards_s": round(old["s"] * n / args.old_shards, 1),
                             "scaled_requests": round(old["requests"] * n / args.old_shards)}
            out["start_up_over_index"] = round(out["start_up"]["s"] / out["index"]["s"], 2)
        finally:
            if proxy is not None:
                proxy.stop()
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
