"""The recipe bench's recipes and the figures of its kept runs: what each recipe name passes to
train.py, and each recipe's mean figures and paired difference from a reference over the runs kept
in RESULTS (bench/results/recipe_runs/STEPS/RECIPE/sSEED.json).

Shared by bench/recipe_bench.py (which runs the recipes, keeps the results and prints their table),
bench/scaling_bench.py, and tools/doc_tables.py (which writes docs/training.md's options table from
the kept runs): bench/ and tools/ never import each other (tests/test_layers.py), so what both read
lives here, beside them. Standard library only.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "bench" / "results" / "recipe_runs"

# What every run shares: the README setting on the bench's store (4 rows, 64 anchors a row).
FIXED = {
    "shards": "0-55",
    "eval_shards": "56-63",
    "batch_size": 4,
    "anchors": 64,
    "threads": 1,
    "workers": 1,
    "save_every": 0,
    "log_every": 10,
    "eval_replay_prompts": 0,
}
# train.py's defaults before this bench chose them: the reference every recipe is paired against.
BASELINE = {
    "batching": "bucketed",
    "slot_weights": "exp",
    "loss_norm": "weights",
    "anchor_rule": "pair",
    "noise_std": 0.0,
    "noise": "gaussian",
    "layer_types": "full",
    "optimizer": "adamw",
    "lr": 6e-4,
    "warmup_ratio": 0.04,
    "schedule": "cosine",
}
PACKED = {"batching": "packed", "max_length": 560, "batch_size": 1}  # ~4 samples a row, as the 4 rows of the others
SLIDING = "sliding,sliding,sliding,sliding,full"
PEER = {
    "slot_weights": "dpace",
    "optimizer": "muon",
    "noise": "uniform",
    "noise_std": 0.05,
    "lr": 1e-4,
    "schedule": "linear",
    "warmup_ratio": 0.01,
    "loss_norm": "labels",
    "anchor_rule": "single",
}
RECIPES: dict[str, dict] = {
    "baseline": {},
    "random": {"batching": "random"},
    "packed": PACKED,
    "dpace": {"slot_weights": "dpace"},
    "labels-norm": {"loss_norm": "labels"},
    "single-anchor": {"anchor_rule": "single"},
    "noise-uniform": {"noise": "uniform", "noise_std": 0.05},
    "noise-gaussian": {"noise_std": 0.05},
    "sliding-last-full": {"layer_types": SLIDING, "sliding_window": 2048},
    "all-sliding": {"layer_types": "sliding", "sliding_window": 2048},
    "muon": {"optimizer": "muon"},
    "linear": {"schedule": "linear"},
    "peer": PEER,  # speculators' DFlash defaults, as far as our flags reach
    # Learning rates and warmup, for combinations ("muon+lr-3e-4": Muon's rate is 10 x --lr).
    "lr-1e-4": {"lr": 1e-4},
    "lr-3e-4": {"lr": 3e-4},
    "lr-1e-3": {"lr": 1e-3},
    "lr-2e-3": {"lr": 2e-3},
    "warmup-0.01": {"warmup_ratio": 0.01},
    "warmup-0.1": {"warmup_ratio": 0.1},
}
# Recipes on top of train.py's defaults of today (as `default`, plus their own fields; no BASELINE under them).
ON_DEFAULTS: dict[str, dict] = {
    # the node-affine order's randomness cost; one process is one node, so this is 56 shards
    # shuffled in windows of 8 (80 samples) against one shuffle of all 560
    "node-window-8": {"data_order": "node", "shuffle_window": 8},
    # the expected-acceptance objective (docs/training.md): mixed half and half with the CE, and alone
    "accept-0.5": {"acceptance_weight": 0.5},
    "accept-1": {"acceptance_weight": 1.0},
    # the gradients' all-reduce in bf16 (--grad-comm): no all-reduce on one process, so it means something
    # only with `run --processes 2` or more, paired against `default` at the same number of processes
    # (default@p2 ran when fp32 was the default, as its train_config records; bf16 is the default since)
    "grad-bf16": {"grad_comm": "bf16"},
    # the DSpark head (docs/training.md, The DSpark head): chain only, DDTree does not apply to it
    "dspark": {"head": "dspark"},
    # the same head with its Markov matrices ([V, r]: an embedding and a vocabulary projection) on AdamW
    # instead of Muon, against dspark (default+dspark-markov-adamw+soft-tv against default+dspark+soft-tv)
    "dspark-markov-adamw": {"head": "dspark", "markov_optimizer": "adamw"},
    # soft targets (docs/training.md, Soft targets): on a store with final states, each mixed half and half
    # with the CE; default+dspark+soft-tv: the DSpark head's TV toward the target's distribution
    "soft-kl": {"soft_targets": "kl"},
    "soft-tv": {"soft_targets": "tv"},
    "soft-accept": {"soft_targets": "accept"},
}
METRICS = (
    "tau",
    "tau_pooled",
    "tau_t1",  # tau at T=1 along the reference (runs replayed on a store with final states; None before)
    "tau_t1_low",  # its lower bound, and greedy drafts verified at T=1 (kept since 2026-12-07; None before)
    "tau_t1_greedy",
    "ddtree16",
    "ddtree64",
    "tau_eos",
    "tau_cut",
    "heldout_loss",
    "heldout_ce",
    "heldout_tau_streak",
    "train_tau_replay",
    "s_per_step",
)


def recipe_flags(name: str) -> dict:
    if name in ON_DEFAULTS:
        return dict(ON_DEFAULTS[name])
    parts = name.split("+")  # a+b: recipe a's fields, then b's on top
    # default+b: today's defaults (no flag) with b's own fields; any other: BASELINE's fields first
    out = {} if parts[0] == "default" else dict(BASELINE)
    for part in parts[parts[0] == "default" :]:
        out.update(ON_DEFAULTS[part] if part in ON_DEFAULTS else RECIPES[part])
    return out


def figures(r: dict) -> dict:
    """One run's METRICS (tau over EOS-ended and cut completions recomputed from its prompts)."""
    groups = {True: [], False: []}
    for p in r["prompts"]:
        if p["tau"] == p["tau"]:  # not NaN
            groups[p["eos"]].append(p["tau"])
    extra = {
        "tau_eos": statistics.mean(groups[True]),
        "tau_cut": statistics.mean(groups[False]) if groups[False] else math.nan,
    }
    return {k: (r.get(k) if k not in extra else extra[k]) for k in METRICS}


T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def interval(diffs: list[float]) -> list[float] | None:
    """95% t-interval of the mean of paired differences (None below 2)."""
    n = len(diffs)
    if n < 2:
        return None
    half = T95.get(n - 1, 1.96) * statistics.stdev(diffs) / math.sqrt(n)
    m = statistics.mean(diffs)
    return [m - half, m + half]


def paired(diffs: list[float], base: float) -> dict:
    """Paired differences summed up: their mean, its 95% t-interval, and the mean relative to base."""
    m = statistics.mean(diffs)
    return {"diff": m, "ci95": interval(diffs), "relative": m / base}


def load(results: Path, steps: int) -> dict[str, dict[int, dict]]:
    runs: dict[str, dict[int, dict]] = {}
    for f in sorted((results / str(steps)).glob("*/s*.json")):
        r = json.loads(f.read_text())
        runs.setdefault(f.parent.name, {})[r["seed"]] = figures(r) | {
            "blocks_per_step": r["blocks_per_step"],
            "flags": r["flags"],
            "store": r.get("train_store") or r["train_config"]["store"],
            "processes": r.get("processes", 1),  # kept before the bench ran several: one
        }
    return runs


def table(results: Path, steps: int, against: str, only: list[str] | None = None) -> dict:
    """only: the kept results to list (with --against), when the budget holds results of other stores."""
    runs = load(results, steps)
    ref = runs.get(against, {})
    if only:
        runs = {name: seeds for name, seeds in runs.items() if name in only or name == against}
    out = {"steps": steps, "against": against, "fixed": FIXED, "baseline_fields": BASELINE, "recipes": {}}
    for name, seeds in sorted(runs.items()):
        row = {
            "seeds": sorted(seeds),
            "flags": seeds[min(seeds)]["flags"],  # as the runs recorded them
            "stores": sorted({seeds[s]["store"] for s in seeds}),
            "processes": sorted({seeds[s]["processes"] for s in seeds}),
        }
        # paired only at the same world size (the bench keeps them under other names too: RECIPE@p2)
        common = sorted(s for s in set(seeds) & set(ref) if seeds[s]["processes"] == ref[s]["processes"])
        for k in METRICS + ("blocks_per_step",):
            vals = [seeds[s][k] for s in sorted(seeds) if seeds[s][k] is not None]
            row[k] = {
                "mean": statistics.mean(vals) if vals else None,
                "sd": statistics.stdev(vals) if len(vals) > 1 else None,
            }
            both = [s for s in common if seeds[s][k] is not None and ref[s][k] is not None]
            if name != against and both and k in METRICS:
                diffs = [seeds[s][k] - ref[s][k] for s in both]
                base = statistics.mean(ref[s][k] for s in both)
                row[k]["paired"] = {"seeds": both, **paired(diffs, base)}
        out["recipes"][name] = row
    return out


def versus(p: dict | None, reference: bool) -> str:
    """A paired difference as 'diff (relative) [95% interval]'."""
    if reference:
        return "reference"
    if not p or p["diff"] is None:
        return "-"
    ci = p["ci95"]
    return f"{p['diff']:+.3f} ({100 * p['relative']:+.1f}%)" + (f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "")
