"""Capture inside vLLM against capture by the target loaded here, on the same token sequences.

    python -m bench.engine_capture_bench --shards 0-7 --threads 1 [--json bench/results/engine_capture_cpu.json]
    python -m bench.engine_capture_bench --responses regenerate --max-new-tokens 128 \
        [--json bench/results/engine_capture_regenerate_cpu.json]

Extracts the same shards in bf16 with `--responses dataset` (the shipped prompts' own answers, so
both paths capture identical sequences and nothing is generated): `--capture transformers` and
`--capture vllm` (vLLM for the CPU platform, its own venv built by tools/engines/build_vllm_cpu.sh),
--repeats times each, alternating. Reports per path the capture's tokens per second (stored tokens
over the time in capture calls), the loop's, and for the engine its start-up, the time waiting for
its replies (its forwards and its connector's writes) and the time reading, checking and deleting its
files here: the transport's share of the capture. With `--responses regenerate` each path also makes
the references (transformers' generate here, the capturing engine's there: the whole of stage one
with the target loaded once either way), and the time generating them is reported beside. On a CPU
the engine and this process share the cores and the shipped target is tiny, so the figures weigh
fixed costs, not a GPU's forwards.

Without the venv, --toy (shard 0, one run of each) prints a "skipped: no vLLM venv" result and exits 0.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.modules.setdefault("fla", None)

from bench import harness  # noqa: E402
from bench.engine_bench import median_run  # noqa: E402
from pipeline import TINY_TARGET  # noqa: E402
from stages.extract.config import ExtractConfig  # noqa: E402
from stages.extract.run import run  # noqa: E402
from tests.engines import VENV  # noqa: E402

TOY = [["--shards", "0"]]


def extract(path: Path, args, **over) -> dict:
    config = ExtractConfig(
        store=str(path),
        target=args.target,
        shards=args.shards,
        dtype="bf16",
        device="cpu",
        responses=args.responses,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        **over,
    )
    s = run(config, log=lambda m: print(m, file=sys.stderr))
    t = s["timing"]
    out = {
        "tokens": s["tokens"],
        "loop_s": round(t["loop_s"], 2),
        "capture_s": round(t["capture_s"], 2),
        "prepare_s": round(t["prepare_s"], 2),
        "generate_s": round(t["generate_s"], 2),  # the references (0 with --responses dataset)
        "stall_s": round(t["stall_s"], 2),  # waiting on the shard writer
        "writer_busy_s": round(t["writer_busy_s"], 2),
        "capture_tokens_per_s": round(s["tokens"] / t["capture_s"], 1) if t["capture_s"] else None,
        "loop_tokens_per_s": round(s["tokens"] / t["loop_s"], 1) if t["loop_s"] else None,
        "agreement": s["agreement"],
    }
    if "capture_engine" in s:
        e = s["capture_engine"]
        out.update({k: round(v, 3) for k, v in e.items()})
        out["transport_share_of_capture"] = round(e["transport_s"] / t["capture_s"], 4) if t["capture_s"] else None
    return out


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--target", default=str(TINY_TARGET))
    p.add_argument("--shards", default="0-7")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--responses", choices=("dataset", "regenerate"), default="dataset", help="whose completions")
    p.add_argument("--max-new-tokens", type=int, default=256, help="completion limit (regenerate: tokens made)")
    p.add_argument("--capture-memory", type=float, default=0.1, help="the engine's share of host memory")
    p.add_argument("--repeats", type=int, default=2, help="runs of each path, alternating; the median is reported")
    args = harness.parse(p)
    if args.toy:
        args.repeats = 1
        if not (VENV / "bin" / "python").exists():
            harness.emit({"skipped": f"no vLLM venv at {VENV} (tools/engines/build_vllm_cpu.sh builds it)"}, args)
            return
    harness.torch_setup(args.threads)
    engine = {"capture": "vllm", "capture_python": str(VENV / "bin" / "python"), "capture_memory": args.capture_memory}
    here, inside = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.repeats):
            here.append(extract(Path(tmp) / f"transformers{k}.zarr", args))
            inside.append(extract(Path(tmp) / f"vllm{k}.zarr", args, **engine))
    a, b = median_run(here), median_run(inside)
    result = {
        "target": args.target,
        "shards": args.shards,
        "batch_size": args.batch_size,
        "responses": args.responses,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "threads": args.threads,
        "transformers": a,
        "vllm": b,
        "capture_ratio_vllm_over_transformers": round(b["capture_s"] / a["capture_s"], 3) if a["capture_s"] else None,
        "loop_ratio_vllm_over_transformers": round(b["loop_s"] / a["loop_s"], 3) if a["loop_s"] else None,
    }
    harness.emit(result, args)


if __name__ == "__main__":
    main()
