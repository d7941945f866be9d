"""The golden run of tests/test_golden.py: what it measures on the small store, and how a measurement
is compared with tests/data/golden_tiny_run.json so that the comparison holds on any x86-64 CPU.

EXACT (the same on every CPU path measured): the CRC-32 of each shard's tokens, loss masks, offsets,
row ids, prompt lengths and first pairs, the store's fingerprint (what made it: target, kernels,
taps, ...), and the held-out streak and replayed taus (counts of argmax agreements). Within TOLERANCE
(relative): what rests on the CPU's floating-point kernels. The bf16 states differ by one rounding
step in a few values out of ten thousands (so their CRC-32s differ), the losses after them from about
the 5th significant digit; the states are compared through a summary per shard and tap
(`state_summary`). Each tolerance is the widest spread measured across CPU paths times 10, rounded up
to 1, 2 or 5: bench/reports/cross_cpu_cpu_2026-12-05.md (`python -m bench.cross_cpu_bench` measures
them again).

    python -m tests.golden OUT.json [--taps 0,1,2,3,4] [-- TRAIN ARGS]   # one measurement, this process's CPU path
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from tests.conftest import SMALL, small_rows
from tests.processes import TINY, losses, train

EXACT_ARRAYS = ("tokens", "loss_mask", "offsets", "row_ids", "prompt_lens", "first_pairs")
# The widest relative spread over 10 CPU points (states 2.9e-6, losses 2.8e-5, held-out loss 4.7e-6) times
# 10, rounded up; the smallest real change measured moved them 0.48, 0.072 and 0.0085.
TOLERANCE = {"states": 5e-5, "train_losses": 5e-4, "loss": 5e-5}
CPU_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")
STEPS = 20


def cpu() -> dict:
    """The CPU path a measurement ran on: torch's ISA capability, the processor, the overrides set."""
    import torch

    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "processor": processor(),
        "torch": torch.__version__,
        "env": {k: os.environ[k] for k in CPU_ENV if k in os.environ},
    }


def processor() -> str:
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")


def describe(path: dict) -> str:
    env = " ".join(f"{k}={v}" for k, v in path["env"].items())
    return f"{path['capability']} ({path['processor']}, torch {path['torch']}{', ' + env if env else ''})"


def states(bits: np.ndarray) -> np.ndarray:
    """bf16 bits [T, n_taps, H] -> float64, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def signs(n: int) -> np.ndarray:
    """A fixed +-1 pattern over n positions (the top bit of splitmix64 of the index): the same on every machine."""
    z = np.arange(n, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return np.where((z ^ (z >> np.uint64(31))) >> np.uint64(63), -1.0, 1.0)


def state_summary(bits: np.ndarray) -> dict:
    """Per tap of one shard's states: values, float64 sum, sum of |x|, sum of squares, and the sum under
    a fixed sign pattern over [token, channel] (`signed`: moves when states move between tokens or
    channels, which the plain sums do not see)."""
    x = states(bits)
    return {str(j): tap_summary(x[:, j].reshape(-1)) for j in range(x.shape[1])}


def tap_summary(tap: np.ndarray) -> dict:
    return {
        "values": int(tap.size),
        "sum": float(tap.sum()),
        "abs_sum": float(np.abs(tap).sum()),
        "sumsq": float((tap * tap).sum()),
        "signed": float((tap * signs(tap.size)).sum()),
    }


def measure(store: Path, out: Path, train_args=()) -> dict:
    """The golden figures of an extracted small store: train STEPS steps of train.py's defaults in the
    TINY setting on shards 0-2, held out 3."""
    import zarr

    from store.hidden_store import HiddenStore

    hs = HiddenStore(str(store))
    records = hs.committed()
    group = zarr.open_group(str(store), mode="r")
    r = train(
        [
            "--store",
            store,
            "--out",
            out,
            "--shards",
            "0-2",
            "--eval-shards",
            "3",
            "--max-steps",
            STEPS,
            "--save-every",
            0,
            *TINY,
            *train_args,
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    final = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["split"] == "eval" and final["step"] == STEPS
    return {
        "cpu": cpu(),
        "exact": {
            "checksums": {str(s): {k: rec.checksums[k] for k in EXACT_ARRAYS} for s, rec in records.items()},
            "store_fingerprint": hs.attrs.fingerprint,
            "tau_streak": final["tau_streak"],
            "tau_replay": final["tau_replay"],
            "replay_prompts": final["replay_prompts"],
        },
        "measured": {
            "states": {str(s): state_summary(group[f"shards/{s:05d}/hidden"][:]) for s in records},
            "train_losses": losses(out),
            "loss": final["loss"],
        },
        "hidden_crc32": {str(s): rec.checksums["hidden"] for s, rec in records.items()},
    }


def relative(want: float, got: float, scale: float) -> float:
    return abs(got - want) / abs(scale) if scale else abs(got - want)


def state_spread(want: dict, got: dict) -> tuple[float, str]:
    """The largest relative difference of two state summaries, and where: sums are relative to the
    sum of |x| (a sum may be near 0), the others to themselves. A missing tap or shard is infinite."""
    worst = (0.0, "")
    for shard, taps in want.items():
        for tap, w in taps.items():
            g = got.get(shard, {}).get(tap)
            if g is None or g["values"] != w["values"]:
                return float("inf"), f"shard {shard} tap {tap}: {w['values']} values, got {g and g['values']}"
            for k in ("sum", "abs_sum", "sumsq", "signed"):
                d = relative(w[k], g[k], w["abs_sum"] if k in ("sum", "signed") else w[k])
                worst = max(worst, (d, f"shard {shard} tap {tap} {k} {w[k]:.9g} -> {g[k]:.9g}"))
    return worst


def spread(want: dict, got: dict) -> dict[str, tuple[float, str]]:
    """Each measured quantity -> (its largest relative difference, where); the states only where both
    have them (the asset's first point, on AVX-512, was recorded before their summary was)."""
    w, g = want["measured"], got["measured"]
    out = {"states": state_spread(w["states"], g["states"])} if "states" in w and "states" in g else {}
    if len(g["train_losses"]) != len(w["train_losses"]):
        out["train_losses"] = (float("inf"), f"{len(w['train_losses'])} losses, got {len(g['train_losses'])}")
    else:
        out["train_losses"] = max(
            (relative(a, b, a), f"step {i + 1} {a:.9g} -> {b:.9g}")
            for i, (a, b) in enumerate(zip(w["train_losses"], g["train_losses"]))
        )
    out["loss"] = (relative(w["loss"], g["loss"], w["loss"]), f"{w['loss']:.9g} -> {g['loss']:.9g}")
    return out


def exact_differences(want: dict, got: dict) -> list[str]:
    """The exact figures that differ; a figure only one side has is left out (the asset's first point,
    on AVX-512, was recorded before the store's fingerprint was)."""
    w, g = want["exact"], got["exact"]
    out = [
        f"shard {s} {name}: CRC-32 {crc} -> {g['checksums'].get(s, {}).get(name)}"
        for s, arrays in w["checksums"].items()
        for name, crc in arrays.items()
        if g["checksums"].get(s, {}).get(name) != crc
    ]
    out += [f"shard {s}: not in the golden store" for s in g["checksums"] if s not in w["checksums"]]
    shared = sorted(w.keys() & g.keys() - {"checksums"})
    return out + [f"{k}: {w[k]} -> {g[k]} (exact on every CPU measured)" for k in shared if w[k] != g[k]]


def differences(want: dict, got: dict) -> list[str]:
    """What of `got` does not hold against `want`: exact figures that differ, and measured ones past
    TOLERANCE, each naming by how much and the two CPU paths."""
    out = exact_differences(want, got)
    for name, (d, where) in spread(want, got).items():
        if d > TOLERANCE[name]:
            out.append(f"{name}: {d:.3g} relative, past the tolerance {TOLERANCE[name]:g} ({where})")
    if out:
        out.append(f"golden written on {describe(want['cpu'])}; this run on {describe(got['cpu'])}")
    return out


def rewritten(old: dict | None, got: dict) -> tuple[dict, list[str]]:
    """The asset `got` makes, and what of the old asset it drops. Earlier measurements on other CPU
    paths (the old reference among them) are kept as `also_measured` while they hold against `got`:
    they show the tolerances admit those CPUs; one that no longer holds is stale and dropped."""
    points = [] if old is None else [old, *old.get("also_measured", [])]
    kept, dropped = [], []
    for p in points:
        point = {k: p[k] for k in ("cpu", "exact", "measured", "hidden_crc32")}
        if p["cpu"] == got["cpu"]:
            continue
        (dropped if differences(point, got) else kept).append(point)
    new = {**got, "also_measured": kept} if kept else got
    return new, [describe(p["cpu"]) for p in dropped]


def extract(path: Path, work: Path, **over) -> None:
    """conftest's small store (shards 0-3 of the small prompt set), extracted in this process."""
    from stages.extract.config import ExtractConfig
    from stages.extract.run import run

    dataset = work / "prompts.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in small_rows()))
    run(
        ExtractConfig(store=str(path), dataset=str(dataset), shards="0-3", num_shards=4, **{**SMALL, **over}),
        log=lambda m: None,
    )


def main(argv: list[str]) -> None:
    import tempfile

    p = argparse.ArgumentParser(description="One golden measurement on this process's CPU path, written as JSON.")
    p.add_argument("out", type=Path)
    p.add_argument("--taps", help="extract these taps, not the target's default (a real change)")
    p.add_argument("train_args", nargs="*", help="after --: extra train.py flags (a real change)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        extract(work / "hs.zarr", work, **({"taps": args.taps} if args.taps else {}))
        got = measure(work / "hs.zarr", work / "run", args.train_args)
    args.out.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":  # conftest, imported above, has set the PyTorch Gated DeltaNet path
    main(sys.argv[1:])
