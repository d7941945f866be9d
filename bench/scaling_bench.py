"""The data-scaling bench: replayed tau of drafters trained with train.py's defaults on the first n
distinct samples of a training pool, at a fixed step budget (and at a fixed n, against the budget),
replayed on an evaluation set no run trains on; and how many held-out prompts a difference needs.

    python tools/heldout_prompts.py --out-dir pipeline/assets        # the two sets (committed)
    pipeline extract --dataset pipeline/assets/heldout_pool.jsonl --store /work/bench/pool.zarr --num-shards 106
    pipeline extract --dataset pipeline/assets/heldout_eval.jsonl --store /work/bench/eval.zarr --num-shards 24
    python -m bench.scaling_bench run --store /work/bench/pool.zarr --eval-store /work/bench/eval.zarr \
        --first-shards 13,26,52,104 --steps 1000 --seeds 0,1,2            # tau against samples
    python -m bench.scaling_bench run --store /work/bench/pool.zarr --eval-store /work/bench/eval.zarr \
        --first-shards 104 --steps 250,500,2000 --seeds 0,1,2             # tau against steps
    python -m bench.scaling_bench table --json bench/results/scaling.json --png docs/img/scaling.png
    python -m bench.scaling_bench size --steps 200 --against muon+dpace+random --json bench/results/heldout_size.json

`run` trains one drafter per (first shards, steps, seed) with recipe_bench's run (train.py's defaults,
the README setting of recipe_results.FIXED) on shards 0..k-1 of --store, validating on --val-shards
(of --store, trained by no point: 104-105 of the pool), replays it with evaluate.py on every shard
of --eval-store (--replay-shards: some of them; --eval-store defaults to --store, for one store with
disjoint ranges), and keeps RESULTS/STEPS/default@nSAMPLES/sSEED.json (recipe_bench's result file;
a kept one is not redone). The pool's shards hold 10 samples each, so the first 13, 26, 52 and 104
shards are 130, 260, 520 and 1,040 distinct samples, each set inside the next (the pool is one
seeded shuffle: any first shards are a random sample). Then it prints the table.

`table`: per (samples, steps) the mean +- sd over seeds of recipe_bench's figures, and the paired
difference (same seeds) from the row before in each curve with its 95% t-interval: tau against
samples at each budget, tau against steps at each sample count.

`size`: from the kept recipe-bench runs of --steps, the paired per-prompt differences between
--against and each recipe named AGAINST+X (same prompts, same seeds), split into a prompt part
(var_prompt: the recipe x prompt interaction, shared by every seed), a seed part (var_seed: one
training run's shift over all prompts) and the rest (var_resid), a two-way analysis of variance
(prompts x seeds). A 95% interval on the mean difference over n independent prompts and S seeds has
half-width 1.96 sqrt(var_prompt/n + var_seed/S + var_resid/(n S)); the prompts it needs for a
half-width of --relative x the reference's tau are n = (var_prompt + var_resid/S) / ((h/1.96)^2 -
var_seed/S), none where the seed part alone is wider. The one-seed figure, n = (1.96 sd / h)^2 with sd
the per-prompt sd of the paired difference within a seed, is printed too.
"""

from __future__ import annotations

import json
import math
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import recipe_results
from bench import harness, recipe_bench

RESULTS = harness.REPO / "bench" / "results" / "scaling_runs"
TOY = [
    [
        "run",
        "--store",
        "{store}",
        "--first-shards",
        "1,2",
        "--val-shards",
        "2",
        "--replay-shards",
        "3",
        "--steps",
        "3",
        "--seeds",
        "0",
        "--jobs",
        "1",
        "--runs",
        "{tmp}/runs",
        "--results",
        "{tmp}/results",
        "--png",
        "{tmp}/scaling.png",
    ],
    ["size", "--steps", "200", "--against", "muon+dpace+random"],
]
RECIPE = "default"  # train.py's defaults, whatever they are today
Z95 = 1.96


def samples_in(store: str, shards: int) -> int:
    """Samples in the store's shards 0..shards-1."""
    from store.hidden_store import HiddenStore
    from store.shard_reader import ShardReader

    hs = HiddenStore(store)
    return sum(len(ShardReader(hs, s)) for s in range(shards))


def run(args) -> dict:
    from store.hidden_store import HiddenStore

    eval_store = args.eval_store or args.store
    replay = args.replay_shards or f"0-{HiddenStore(eval_store).num_shards - 1}"
    points = {k: samples_in(args.store, k) for k in map(int, args.first_shards.split(","))}
    jobs = [
        (k, steps, int(s)) for k in points for steps in map(int, args.steps.split(",")) for s in args.seeds.split(",")
    ]

    def one(k: int, steps: int, seed: int) -> str:
        fixed = {
            **recipe_results.FIXED,
            "shards": f"0-{k - 1}",
            "eval_shards": args.val_shards,
            **({"log_every": 1} if args.toy else {}),
        }
        return str(
            recipe_bench.one_run(
                args.store,
                RECIPE,
                seed,
                steps,
                Path(args.runs),
                Path(args.results),
                eval_store,
                f"n{points[k]}",
                fixed=fixed,
                replay_shards=replay,
            )
        )

    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {job: pool.submit(one, *job) for job in jobs}
        return {f"{points[k]} samples, {steps} steps, seed {s}": f.result() for (k, steps, s), f in futures.items()}


def table(results: Path) -> dict:
    """{"rows": [...]} per (samples, steps), and the two curves as lists of row indices."""
    cells: dict[tuple[int, int], dict[int, dict]] = {}
    budgets = sorted(int(p.name) for p in results.iterdir() if p.name.isdigit()) if results.is_dir() else []
    for budget in budgets:
        for name, seeds in recipe_results.load(results, budget).items():
            cells[(int(name.split("@n")[1]), budget)] = seeds
    rows = []
    for (samples, steps), seeds in sorted(cells.items()):
        row = {"samples": samples, "steps": steps, "seeds": sorted(seeds)}
        for k in recipe_results.METRICS:
            vals = [seeds[s][k] for s in sorted(seeds) if seeds[s][k] is not None and seeds[s][k] == seeds[s][k]]
            row[k] = {
                "mean": statistics.mean(vals) if vals else None,
                "sd": statistics.stdev(vals) if len(vals) > 1 else None,
            }
        rows.append(row)
    curves = {"samples": _curves(rows, "steps", "samples", cells), "steps": _curves(rows, "samples", "steps", cells)}
    shared = {k: v for k, v in recipe_results.FIXED.items() if k not in ("shards", "eval_shards")}  # each row its own
    return {"fixed": shared, "recipe": RECIPE, "rows": rows, "curves": curves}


def _curves(rows: list[dict], fixed: str, along: str, cells: dict) -> list[dict]:
    """Rows sharing `fixed` (two or more), ordered by `along`, each with the paired chain-tau
    difference from the one before."""
    out = []
    for value in sorted({r[fixed] for r in rows}):
        line = sorted((r for r in rows if r[fixed] == value), key=lambda r: r[along])
        if len(line) < 2:
            continue
        steps = []
        for prev, row in zip([None] + line[:-1], line):
            step = {along: row[along], "row": rows.index(row)}
            if prev is not None:
                a, b = (cells[(r["samples"], r["steps"])] for r in (row, prev))
                diffs = [a[s]["tau"] - b[s]["tau"] for s in sorted(set(a) & set(b))]
                step["vs_before"] = {"diff": statistics.mean(diffs), "ci95": recipe_results.interval(diffs)}
            steps.append(step)
        out.append({fixed: value, "points": steps})
    return out


def markdown(t: dict) -> str:
    cols = [
        ("tau", "chain tau"),
        ("tau_pooled", "pooled"),
        ("ddtree16", "DDTree-16"),
        ("ddtree64", "DDTree-64"),
        ("tau_eos", "tau, EOS-ended"),
        ("heldout_ce", "val CE"),
        ("s_per_step", "s/step"),
    ]
    out = []
    for along, fixed in (("samples", "steps"), ("steps", "samples")):
        for curve in t["curves"][along]:
            out += [
                f"\ntau against {along} at {curve[fixed]} {fixed} ({t['recipe']})\n",
                f"| {along} | seeds | " + " | ".join(c for _, c in cols) + " | chain tau vs the row before |",
                "|" + " --- |" * (len(cols) + 3),
            ]
            for p in curve["points"]:
                row = t["rows"][p["row"]]
                cells = [
                    "-"
                    if row[k]["mean"] is None
                    else f"{row[k]['mean']:.3f}" + (f" ± {row[k]['sd']:.3f}" if row[k]["sd"] is not None else "")
                    for k, _ in cols
                ]
                v = p.get("vs_before")
                vs = (
                    "-"
                    if v is None
                    else f"{v['diff']:+.3f}" + (f" [{v['ci95'][0]:+.3f}, {v['ci95'][1]:+.3f}]" if v["ci95"] else "")
                )
                out.append(f"| {p[along]} | {len(row['seeds'])} | " + " | ".join(cells) + f" | {vs} |")
    return "\n".join(out) if out else "(no curve: fewer than two points share a budget or a sample count)"


def plot(t: dict, png: Path) -> Path:
    """Chain, pooled and DDTree-64 tau (mean over seeds, +- sd when more than one) against samples at each
    step budget, and against steps at each sample count: one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, (along, fixed) in zip(axes, (("samples", "steps"), ("steps", "samples"))):
        for curve in t["curves"][along]:
            rows = [t["rows"][p["row"]] for p in curve["points"]]
            for key, label, marker in (
                ("tau", "chain", "o"),
                ("tau_pooled", "pooled", "s"),
                ("ddtree64", "DDTree-64", "^"),
            ):
                ax.errorbar(
                    [r[along] for r in rows],
                    [r[key]["mean"] for r in rows],
                    yerr=[r[key]["sd"] or 0.0 for r in rows],
                    marker=marker,
                    markersize=4,
                    linewidth=0.8,
                    capsize=2,
                    label=f"{label}, {curve[fixed]:,} {fixed}",
                )
        ax.set_xscale("log", base=2)
        xs = sorted({t["rows"][p["row"]][along] for curve in t["curves"][along] for p in curve["points"]})
        ax.set_xticks(xs, [f"{x:,}" for x in xs])
        ax.minorticks_off()
        ax.set(
            xlabel="distinct training samples" if along == "samples" else "optimizer steps",
            ylabel="tau (tokens per round)",
            title=f"tau against {along}",
        )
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    seeds = sorted({len(r["seeds"]) for r in t["rows"]})
    fig.suptitle(
        f"{t['recipe']} (train.py's defaults), held-out replay; seeds a point: {', '.join(map(str, seeds)) or 'none'}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def per_prompt(results: Path, steps: int, name: str) -> dict[int, dict[tuple, float]]:
    """{seed: {(shard, index): chain tau}} of one kept recipe-bench result."""
    out = {}
    for f in sorted((results / str(steps) / name).glob("s*.json")):
        r = json.loads(f.read_text())
        out[r["seed"]] = {(p["shard"], p["index"]): p["tau"] for p in r["prompts"]}
    return out


def components(a: dict, b: dict) -> dict:
    """Two-way (prompts x seeds) analysis of variance of the paired differences a - b."""
    seeds = sorted(set(a) & set(b))
    keys = sorted(set.intersection(*(set(a[s]) & set(b[s]) for s in seeds)))
    d = [[a[s][k] - b[s][k] for s in seeds] for k in keys]  # [prompts][seeds]
    n, S = len(keys), len(seeds)
    grand = statistics.mean(x for r in d for x in r)
    pm = [statistics.mean(r) for r in d]
    sm = [statistics.mean(d[i][j] for i in range(n)) for j in range(S)]
    ms_p = S * sum((m - grand) ** 2 for m in pm) / (n - 1)
    ms_s = n * sum((m - grand) ** 2 for m in sm) / (S - 1)
    ms_r = sum((d[i][j] - pm[i] - sm[j] + grand) ** 2 for i in range(n) for j in range(S)) / ((n - 1) * (S - 1))
    sd = math.sqrt(statistics.mean(statistics.variance([d[i][j] for i in range(n)]) for j in range(S)))
    return {
        "prompts": n,
        "seeds": seeds,
        "diff": grand,
        "sd_prompt": sd,
        "var_prompt": (ms_p - ms_r) / S,
        "var_seed": (ms_s - ms_r) / n,
        "var_resid": ms_r,
    }


def size(results: Path, steps: int, against: str, relative: float, recipes: list[str] | None) -> dict:
    names = recipes or sorted(p.name for p in (results / str(steps)).iterdir() if p.name.startswith(against + "+"))
    ref = per_prompt(results, steps, against)
    if not ref or not names:
        raise SystemExit(f"error: {results / str(steps)}: no kept runs of {against!r} and recipes to pair with it")
    pairs = {name: components(per_prompt(results, steps, name), ref) for name in names}
    pooled = {k: statistics.mean(c[k] for c in pairs.values()) for k in ("var_prompt", "var_seed", "var_resid")}
    pooled["sd_prompt"] = math.sqrt(statistics.mean(c["sd_prompt"] ** 2 for c in pairs.values()))
    tau = statistics.mean(statistics.mean(v.values()) for v in ref.values())
    half = relative * tau
    need = {}
    for S in (1, 3, 5, 6, 8, 10, 20):
        room = (half / Z95) ** 2 - pooled["var_seed"] / S
        n = (pooled["var_prompt"] + pooled["var_resid"] / S) / room if room > 0 else None
        need[S] = {
            "prompts": None if n is None else math.ceil(n),
            "seed_floor": Z95 * math.sqrt(max(pooled["var_seed"], 0) / S),
        }
    m, S0 = next(iter(pairs.values()))["prompts"], len(ref)
    bench_half = recipe_results.T95[S0 - 1] * math.sqrt((pooled["var_seed"] + pooled["var_resid"] / m) / S0)
    return {
        "steps": steps,
        "against": against,
        "reference_tau": tau,
        "relative": relative,
        "half_width": half,
        "pairs": pairs,
        "pooled": pooled,
        "one_seed_prompts": math.ceil((Z95 * pooled["sd_prompt"] / half) ** 2),
        "needed": need,
        "bench_half_width": bench_half,
        "bench_prompts": m,
        "bench_seeds": S0,
    }


def size_markdown(r: dict) -> str:
    p = r["pooled"]
    lines = [
        f"{len(r['pairs'])} pairs against {r['against']} (tau {r['reference_tau']:.3f}) at {r['steps']} steps; "
        f"half-width {100 * r['relative']:.0f}% = {r['half_width']:.3f}",
        f"pooled: sd per prompt {p['sd_prompt']:.3f}, var_prompt {p['var_prompt']:.4f}, "
        f"var_seed {p['var_seed']:.4f}, var_resid {p['var_resid']:.4f}",
        f"one seed: n = (1.96 x {p['sd_prompt']:.3f} / {r['half_width']:.3f})^2 = {r['one_seed_prompts']}",
        f"the recipe bench's own interval ({r['bench_prompts']} prompts, {r['bench_seeds']} seeds, t): "
        f"+-{r['bench_half_width']:.3f}",
        "",
        "| seeds | prompts needed | seed part alone (+-) |",
        "| --- | --- | --- |",
    ]
    lines += [
        f"| {S} | {v['prompts'] if v['prompts'] is not None else 'none suffices'} | {v['seed_floor']:.3f} |"
        for S, v in r["needed"].items()
    ]
    return "\n".join(lines)


def main() -> None:
    ap = harness.parser(__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = harness.subcommand(sub, "run", "train and replay the (first shards, steps, seed) runs not kept yet")
    r.add_argument("--store", required=True, help="the training pool's store (shards of equal size)")
    r.add_argument("--eval-store", help="the evaluation set's store (default: --store)")
    r.add_argument("--first-shards", required=True, help="comma-separated k: train on shards 0..k-1")
    r.add_argument(
        "--val-shards", default="104-105", help="train.py's --eval-shards (of --store; no point trains on them)"
    )
    r.add_argument("--replay-shards", help="shards of --eval-store to replay (default: all)")
    r.add_argument("--steps", default="1000", help="comma-separated step budgets")
    r.add_argument("--seeds", default="0,1,2")
    r.add_argument("--jobs", type=int, default=2)
    r.add_argument("--runs", default="/tmp/scaling_bench", help="where run directories go (large; not kept)")
    r.add_argument("--results", default=str(RESULTS))
    r.add_argument("--png", help="also plot the curves into this PNG (as `table --png`)")
    t = harness.subcommand(sub, "table", "summarize the kept runs")
    t.add_argument("--results", default=str(RESULTS))
    t.add_argument("--png", help="also plot the curves into this PNG (docs/img/scaling.png)")
    s = harness.subcommand(sub, "size", "how many held-out prompts a difference needs, from kept recipe-bench runs")
    s.add_argument("--steps", type=int, default=200)
    s.add_argument("--against", default="muon+dpace+random")
    s.add_argument("--recipes", help="comma-separated kept recipes (default: every AGAINST+X)")
    s.add_argument("--relative", type=float, default=0.02, help="the half-width, as a fraction of the reference's tau")
    s.add_argument("--results", default=str(recipe_results.RESULTS))
    args = harness.parse(ap)
    if args.cmd == "size":
        result = size(
            Path(args.results),
            args.steps,
            args.against,
            args.relative,
            args.recipes.split(",") if args.recipes else None,
        )
        print(size_markdown(result))
        harness.emit(result, args)
        return
    kept = run(args) if args.cmd == "run" else None
    result = table(Path(args.results)) | ({"runs": kept} if kept else {})
    print(markdown(result))
    if args.png:
        print(f"plot: {plot(result, Path(args.png))}")
    harness.emit(result, args)


if __name__ == "__main__":
    main()
