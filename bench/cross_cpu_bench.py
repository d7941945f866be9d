"""How far the golden numbers (tests/golden.py) move across CPU code paths, and how far a real change
moves them: what tests/golden.py's TOLERANCE is set from.

    OMP_NUM_THREADS=1 python -m bench.cross_cpu_bench [--paths default,aten-default] [--changes taps-shifted]
        [--json bench/results/cross_cpu_cpu.json]

Each CPU path is this machine with one library's dispatch forced by its environment variable (ATen's
kernels, oneDNN's, MKL's), each change a real behaviour change on the default path; each runs the
whole golden measurement (extract the small store, train 20 steps, validate) in a child process.
Reported per run: whether the exact figures equal the asset's, and each measured quantity's largest
relative difference from this machine's default path, and the widest difference over every pair of
CPU points (the asset's, its `also_measured` ones included), against the tolerance. --toy: the
default path only.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from itertools import combinations
from pathlib import Path

from bench import harness
from tests import golden

TOY = [[]]
ASSET = harness.REPO / "tests" / "data" / "golden_tiny_run.json"
PATHS = {
    "default": {},
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
    "onednn-avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "onednn-sse41": {"ONEDNN_MAX_CPU_ISA": "SSE41"},
    "mkl-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "mkl-sse4_2": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "mkl-cbwr-compatible": {"MKL_CBWR": "COMPATIBLE"},
    "all-forced": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_CBWR": "COMPATIBLE"},
}
CHANGES = {
    "taps-shifted": ["--taps", "0,1,2,3,4"],
    "lr-5e-4": ["--", "--lr", "5e-4"],
    "anchors-15": ["--", "--anchors", "15"],
    "seed-1": ["--", "--seed", "1"],
}


def measure(env: dict, args: list[str], threads: int) -> dict:
    """One golden measurement in a child process with env added (its CPU path)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "golden.json"
        full = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **env}
        r = subprocess.run(
            harness.python("-m", "tests.golden", str(out), *args),
            cwd=harness.REPO,
            env=full,
            capture_output=True,
            text=True,
        )
        if r.returncode:
            raise RuntimeError(f"golden measurement with {env} {args} failed:\n{r.stderr[-3000:]}")
        return json.loads(out.read_text())


def versus(want: dict, got: dict) -> dict:
    """got against want: exact figures that differ, and each quantity's (relative difference, where)."""
    return {
        "exact_differences": golden.exact_differences(want, got),
        "spread": {k: {"relative": d, "where": w} for k, (d, w) in golden.spread(want, got).items()},
    }


def widest(points: dict) -> dict:
    """Each quantity's largest relative difference over every pair of CPU points, and the pair."""
    out = {}
    for (a, pa), (b, pb) in combinations(points.items(), 2):
        for k, (d, where) in golden.spread(pa, pb).items():
            if d >= out.get(k, {"relative": -1})["relative"]:
                out[k] = {"relative": d, "pair": [a, b], "where": where}
    return out


def table(result: dict) -> str:
    """Markdown: each run's largest relative difference from the default path, per quantity."""
    names = list(golden.TOLERANCE)
    lines = [
        "| run (against this machine's default path) | exact figures | " + " | ".join(names) + " |",
        "|---" * (len(names) + 2) + "|",
    ]
    for name, r in {**result["paths"], **result["changes"]}.items():
        v = r["vs_default"]
        cells = [f"{v['spread'][k]['relative']:.2g}" for k in names]
        lines.append(f"| {name} | {'equal' if not v['exact_differences'] else 'differ'} | {' | '.join(cells)} |")
    widest = result["widest_cpu_spread"]
    lines.append(
        "| widest over every pair of CPU points | | " + " | ".join(f"{widest[k]['relative']:.2g}" for k in names) + " |"
    )
    return "\n".join(lines + ["| tolerance | | " + " | ".join(f"{golden.TOLERANCE[k]:g}" for k in names) + " |"])


def run(args) -> dict:
    asset = json.loads(ASSET.read_text())
    paths = ["default"] if args.toy else ["default", *(p for p in pick(args.paths, PATHS) if p != "default")]
    got = {p: measure(PATHS[p], [], args.threads) for p in paths}
    changed = {c: measure({}, CHANGES[c], args.threads) for c in ([] if args.toy else pick(args.changes, CHANGES))}
    points = {f"asset {golden.describe(p['cpu'])}": p for p in [asset, *asset.get("also_measured", [])]} | got
    base = got["default"]
    return {
        "asset_cpu": asset["cpu"],
        "tolerance": golden.TOLERANCE,
        "widest_cpu_spread": widest(points),
        "paths": {
            p: {"env": PATHS[p], "cpu": m["cpu"], "vs_default": versus(base, m), "vs_asset": versus(asset, m)}
            for p, m in got.items()
        },
        "changes": {c: {"args": CHANGES[c], "vs_default": versus(base, m)} for c, m in changed.items()},
        "measurements": {**got, **changed},
    }


def pick(names: str, known: dict) -> list[str]:
    return list(known) if names == "all" else [n for n in names.split(",") if n]


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--paths", default="all", help=f"CPU paths, comma-separated, or 'all': {', '.join(PATHS)}")
    p.add_argument("--changes", default="all", help=f"real changes, comma-separated, or 'all': {', '.join(CHANGES)}")
    args = harness.parse(p)
    result = run(args)
    print(table(result))
    harness.emit(result, args)


if __name__ == "__main__":
    main()
