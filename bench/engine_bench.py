"""References from a real vLLM server against transformers' generate, on the same prompts.

    python -m bench.engine_bench --shards 0-7 --threads 2 [--target DIR] [--json bench/results/engine_cpu.json]

Extracts the same shards twice in bf16 on this machine: `--responses regenerate` (generate in
process) and `--responses server` (vLLM for the CPU platform, its own venv built by
tools/engines/build_vllm_cpu.sh, started on 127.0.0.1 for the run). Reports completion tokens per
second of each reference path, the capture time, and the time spent outside the model per sample
with the server (the loop minus waiting for the server minus the capture forward), plus how many
stored completions agree between the two paths and each store's agreement figure. On a CPU the
engine and the extraction share the cores; what carries over to GPUs is the ratio's direction, not
its size.

The vLLM venv ($DFLASH_ENGINE_VENV, default ~/.cache/dflash-pipeline/vllm-cpu-venv) is built on the
first run if absent, except with --toy (shard 0's first 16 new tokens, one run of each path): without
the venv the toy run prints a "skipped: no vLLM venv" result and exits 0.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.modules.setdefault("fla", None)

from bench import harness  # noqa: E402
from pipeline import TINY_TARGET  # noqa: E402
from stages.extract.config import ExtractConfig  # noqa: E402
from stages.extract.run import run  # noqa: E402
from store.hidden_store import HiddenStore  # noqa: E402
from store.shard_reader import ShardReader  # noqa: E402
from tests.engines import VENV, VllmServer  # noqa: E402

TOY = [["--shards", "0"]]


def extract(path: Path, args, **over) -> dict:
    config = ExtractConfig(
        store=str(path),
        target=args.target,
        shards=args.shards,
        dtype="bf16",
        device="cpu",
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        **over,
    )
    s = run(config, log=lambda m: print(m, file=sys.stderr))
    t = s["timing"]
    completion = sum(r.completion_tokens for r in HiddenStore(str(path)).committed().values())
    outside = t["loop_s"] - t["generate_s"] - t["capture_s"]
    return {
        "samples": s["samples"],
        "completion_tokens": completion,
        "loop_s": round(t["loop_s"], 2),
        "reference_s": round(t["generate_s"], 2),
        "capture_s": round(t["capture_s"], 2),
        "reference_tokens_per_s": round(completion / t["generate_s"], 1) if t["generate_s"] else None,
        "outside_model_ms_per_sample": round(1e3 * outside / max(1, s["samples"]), 2),
        "agreement": s["agreement"],
    }


def completions(path: Path) -> dict:
    store = HiddenStore(str(path))
    return {
        (s.shard, s.row_id): s.tokens[s.prompt_len :].tolist()
        for shard in store.committed()
        for s in ShardReader(store, shard)
    }


def median_run(runs: list[dict]) -> dict:
    """The run with the median loop time (the upper one of an even count), plus every run's loop time."""
    ordered = sorted(runs, key=lambda r: r["loop_s"])
    return {**ordered[len(ordered) // 2], "loop_s_runs": [r["loop_s"] for r in runs]}


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--target", default=str(TINY_TARGET))
    p.add_argument("--shards", default="0-7")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="runs of each path, alternating; the median is reported")
    args = harness.parse(p)
    if args.toy:
        args.max_new_tokens, args.repeats = 16, 1
        if not (VENV / "bin" / "python").exists():
            harness.emit({"skipped": f"no vLLM venv at {VENV} (tools/engines/build_vllm_cpu.sh builds it)"}, args)
            return
    harness.torch_setup(args.threads)
    local, remote = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        server = VllmServer(Path(args.target), tmp / "vllm.log").start()
        try:
            for k in range(args.repeats):
                local.append(extract(tmp / f"generate{k}.zarr", args))
                remote.append(
                    extract(
                        tmp / f"server{k}.zarr",
                        args,
                        responses="server",
                        server_url=server.url,
                        concurrency=args.concurrency,
                    )
                )
        finally:
            server.stop()
        a, b = completions(tmp / "generate0.zarr"), completions(tmp / "server0.zarr")
    same = sum(a[k] == b.get(k) for k in a)
    result = {
        "target": args.target,
        "shards": args.shards,
        "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "note": "the server idles while `generate` runs (one core-set shared by both paths)",
        "generate": median_run(local),
        "vllm": median_run(remote),
        "loop_ratio_vllm_over_generate": round(median_run(remote)["loop_s"] / median_run(local)["loop_s"], 3),
        "completions_equal": same,
        "completions": len(a),
    }
    harness.emit(result, args)


if __name__ == "__main__":
    main()
