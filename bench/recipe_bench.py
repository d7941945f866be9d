"""The recipe bench: how good a drafter each training recipe makes, measured as replayed tau on
held-out prompts of the shipped tiny target, several seeds per recipe, paired against a reference.

    pipeline extract --store /work/bench/hs.zarr --shards 0-63          # once: 640 prompts
    python -m bench.recipe_bench run --store /work/bench/hs.zarr --recipes baseline,random --seeds 0,1,2 --steps 200
    python -m bench.recipe_bench table --steps 200 --against baseline --json bench/results/recipe_200.json --force

`run` trains one drafter per (recipe, seed) with train.py on shards 0-55 and replays it with
evaluate.py on every prompt of the held-out shards 56-63 (80 prompts; chain and DDTree-16/64;
fp32, see REPLAY; on a store with final states also tau at T=1: REPLAY_TEMPERATURE), then keeps
what it measured in RESULTS/STEPS/RECIPE/sSEED.json: the recipe's flags, the checkpoint's
train_config, the held-out loss, streak tau and training validation's replayed tau, s/step, and the
report's tau figures with every prompt's tau, its completion length and whether the completion
ended in EOS or was cut at the length limit. A run whose file exists is not redone, so a later
session adds recipes without rerunning the others.
--jobs 2 (the default for one process) runs two single-threaded runs side by side: both cores of
the development machine.

Several processes: `run --processes 2` trains each drafter as 2 real DDP processes on CPU (accelerate
launch --multi_gpu; gloo), each single-threaded, so the gradients are all-reduced between them (with
one process there is no all-reduce: --grad-comm changes nothing). --batch-size counts rows per
process, so each process gets the recipe's rows divided by the processes (FIXED's 4: 2 each): the
global batch, the samples a step reads and the optimizer steps stay the one-process recipe's. The
runs are kept as RECIPE@p2 (RECIPE@LABEL-p2), so `table` never pairs runs of different world sizes,
and each result records its processes and the world size every rank's --audit file reported. The
gradients' all-reduce in bf16 against fp32 (--jobs 1: one run takes both cores):

    python -m bench.recipe_bench run --store /work/bench/hs.zarr --recipes default,grad-bf16 --processes 2 --jobs 1
    python -m bench.recipe_bench table --steps 200 --against default@p2 --only grad-bf16@p2

The hidden formats: train on an fp8 store and replay on the bf16 store of the same prompts
(how such a drafter is served), then replay the same drafters on the fp8 store:

    python -m bench.recipe_bench run --store fp8.zarr --train-tag fp8 --replay-store bf16.zarr --recipes default
    python -m bench.recipe_bench run --store fp8.zarr --train-tag fp8 --label fp8-on-fp8 --recipes default

The kernel paths: train on the torch-path and the fla-path fp32 stores of the same prompts
(`python -m bench.parity fla extract`) and replay each drafter on the other path's store too, below the evaluator's
fingerprint check (`--allow-mismatch`, recorded in the result):

    python -m bench.recipe_bench run --store torch-fp32.zarr --train-tag fp32-torch --recipes default
    python -m bench.recipe_bench run --store torch-fp32.zarr --train-tag fp32-torch --label fp32-torch-on-fla \
        --replay-store fla-fp32.zarr --allow-mismatch --recipes default

Continuing drafters: every seed starts from its own earlier run's checkpoint (train.py --init-from,
"{seed}" filled in) and trains --steps more, kept under the label (a fresh optimizer and schedule):

    python -m bench.recipe_bench run --store /work/bench/hs.zarr --recipes default,accept-1 --steps 200 \
        --init-from /work/bench_runs/1000/default/s{seed}/final --label from-1000

`table` reads the kept runs of one budget: per recipe the mean +- sd over seeds of each figure, and
the paired difference from --against over the seeds both have, with its 95% t-interval (n - 1
degrees of freedom) and the difference relative to the reference's mean. Tau is also given over
the completions that end in EOS and over those cut at the length limit (the tiny target's greedy
loops), each as the mean over those prompts.

Every recipe spells out all the fields it sets (BASELINE, the defaults before the bench chose
them, plus its own), so a recipe keeps its meaning when train.py's defaults change; `default`
passes no recipe flag at all (whatever train.py's defaults are today) and its train_config is kept,
and the ON_DEFAULTS recipes pass only their own fields on top of it (paired against `default`), as does
`default+a+b`: today's defaults with the fields of recipes a and b (`default+all-sliding`). The recipes
(RECIPES, ON_DEFAULTS, BASELINE, FIXED) and `table`'s arithmetic are recipe_results.py's, beside bench/:
tools/doc_tables.py reads them too.

`table` prints the table as markdown, then the result (JSON; --json writes it, over a kept file only
with --force); `run` writes each run's file itself (the layout above) and prints their paths.
--threads is not used: every run is single-threaded (FIXED). --toy: `run` trains on shards 0-2 of
the store and replays its shard 3, logging every step (pass a few --steps and a --results of its own).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import harness
from recipe_results import FIXED, RESULTS, recipe_flags, table, versus
from tests.processes import cpu_ddp

ROOT = harness.REPO
TOY = [
    ["table", "--steps", "200"],
    [
        "run",
        "--store",
        "{store}",
        "--recipes",
        "default",
        "--seeds",
        "0",
        "--steps",
        "3",
        "--jobs",
        "1",
        "--runs",
        "{tmp}/runs",
        "--results",
        "{tmp}/results",
    ],
    [
        "run",
        "--store",
        "{store}",
        "--recipes",
        "accept-1",
        "--seeds",
        "0",
        "--steps",
        "3",
        "--jobs",
        "1",
        "--init-from",
        "{checkpoint}",
        "--label",
        "ft",
        "--runs",
        "{tmp}/runs",
        "--results",
        "{tmp}/results",
    ],
    [
        "run",
        "--store",
        "{store}",
        "--recipes",
        "grad-bf16",
        "--seeds",
        "0",
        "--steps",
        "3",
        "--processes",
        "2",
        "--runs",
        "{tmp}/runs",
        "--results",
        "{tmp}/results",
    ],
]
TOY_FIXED = {"shards": "0-2", "eval_shards": "3", "log_every": 1}

# The replay: every held-out prompt, chain and DDTree-16/64. fp32, not evaluate.py's default bf16: on this
# CPU (no native bf16 matmul) bf16 replay took 4.7x as long (172 s against 37 s on 80 prompts), and the
# two gave chain tau 1.140 and 1.137, DDTree-64 1.981 and 1.982 on the same drafter.
REPLAY = ["--max-prompts", "all", "--ddtree", "16,64", "--threads", "1", "--dtype", "fp32"]
# On a replay store with final states every run also reports tau at this temperature (evaluate.py
# --temperature: along the stored reference), kept as tau_t1, with its lower bound (tau_t1_low) and
# greedy drafts verified at that temperature (tau_t1_greedy).
REPLAY_TEMPERATURE = 1.0


def temperature_flags(replay_store: str) -> list[str]:
    """--temperature REPLAY_TEMPERATURE when the replay store holds final states, else nothing."""
    from store.hidden_store import HiddenStore

    return ["--temperature", f"{REPLAY_TEMPERATURE:g}"] if HiddenStore(replay_store).layout.final_state else []


def replay_flags(fields: dict) -> list[str]:
    """REPLAY, chain only for a dspark drafter (evaluate.py refuses DDTree for it)."""
    return [*REPLAY[:2], "--ddtree", "none", *REPLAY[4:]] if fields.get("head") == "dspark" else REPLAY


def argv(fields: dict) -> list[str]:
    return [x for k, v in fields.items() for x in ("--" + k.replace("_", "-"), str(v))]


def tagged(name: str, tag: str) -> str:
    return f"{name}@{tag}" if tag else name


def world_tag(tag: str, processes: int) -> str:
    """A tag (train tag or label) naming the processes a run trained on: '' -> 'p2', 'fp8' -> 'fp8-p2';
    unchanged for one process, so the kept one-process runs keep their names."""
    if processes == 1:
        return tag
    return f"{tag}-p{processes}" if tag else f"p{processes}"


def per_process(fields: dict, processes: int) -> dict:
    """A recipe's train.py fields with its rows a step split between the processes (--batch-size counts
    rows per process): the global batch stays the one-process recipe's. ValueError if they do not split."""
    rows = fields["batch_size"]
    if rows % processes:
        raise ValueError(f"--processes {processes}: the recipe's {rows} rows a step do not split evenly between them")
    return {**fields, "batch_size": rows // processes}


def launcher(processes: int) -> list[str]:
    """What starts train.py: python for one process; for several, accelerate launch of as many CPU
    processes with real DDP (tests/processes.cpu_ddp) on a free port."""
    return [sys.executable] if processes == 1 else cpu_ddp(processes)


def world_size(run_dir: Path, processes: int) -> int:
    """The processes that trained run_dir, checked against every rank's --audit file (each must report
    `processes` and the same parameters: the gradients were all-reduced). 1 without audit files."""
    audits = sorted((run_dir / "audit").glob("rank-*.json"))
    if processes == 1 and not audits:
        return 1
    ranks = [json.loads(a.read_text()) for a in audits]
    sizes = [r["world_size"] for r in ranks]
    hashes = {r["param_sha256"] for r in ranks}
    if sizes != [processes] * processes or len(hashes) != 1:
        raise RuntimeError(
            f"{run_dir}: trained for --processes {processes}, but its ranks' audit files report world sizes "
            f"{sizes} and {len(hashes)} different parameter hashes"
        )
    return processes


def one_run(
    store: str,
    name: str,
    seed: int,
    steps: int,
    runs: Path,
    results: Path,
    replay_store: str | None = None,
    train_tag: str = "",
    label: str = "",
    allow_mismatch: bool = False,
    fixed: dict | None = None,
    replay_shards: str | None = None,
    init_from: str = "",
    processes: int = 1,
) -> Path:
    """Train and replay one (recipe, seed) unless its result is kept -> the result file. train_tag names
    the training store in the run directory, label the result (default: train_tag); a finished training
    of the same recipe, seed and train_tag is replayed again rather than redone (replay_store: another
    store of the same prompts, such as the bf16 store of an fp8-trained drafter; allow_mismatch: replay
    it below the evaluator's fingerprint check, as the result then records). fixed: what the run shares
    instead of FIXED; replay_shards: the shards of the replay store to replay (default: its eval_shards);
    init_from: a drafter checkpoint to start from ("{seed}" in it: the run's seed), run and kept under label.
    processes: train as that many DDP processes (the rows a step split between them), the train tag and the
    label naming them (world_tag)."""
    fixed = fixed or FIXED
    train_tag, label = world_tag(train_tag, processes), world_tag(label, processes) if label else ""
    out = results / str(steps) / tagged(name, label or train_tag) / f"s{seed}.json"
    if out.exists():
        return out
    start = init_from.format(seed=seed)  # this seed's checkpoint, or "" (from scratch)
    run_dir = runs / str(steps) / tagged(name, label if start else train_tag) / f"s{seed}"  # never a scratch run's
    done = run_dir / "train_seconds.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if not done.exists():
        train_s = train_one(store, name, seed, steps, run_dir, env, fixed, start, processes)
        done.write_text(f"{train_s}\n")
    train_s = float(done.read_text())
    report = run_dir / f"report-{label or train_tag or 'own'}"
    replay_store = replay_store or store
    mismatch = ["--allow-mismatch"] if allow_mismatch else []
    # named: a checkpoint without store_placement would replay every shard a --replay-store holds
    held_out = ["--shards", replay_shards or fixed["eval_shards"]]
    _call(
        [
            sys.executable,
            str(ROOT / "evaluate.py"),
            "--store",
            replay_store,
            "--checkpoint",
            str(run_dir / "final"),
            "--out",
            str(report),
            "--force",
            *held_out,
            *replay_flags(recipe_flags(name)),
            *temperature_flags(replay_store),
            *mismatch,
        ],
        env,
        run_dir.parent / f"s{seed}.eval-{label or train_tag}.log",
    )
    result = collect(
        replay_store, tagged(name, label or train_tag), seed, steps, recipe_flags(name), run_dir, report, train_s, fixed
    )
    result |= {
        "processes": processes,
        "world_size": world_size(run_dir, processes),
        "train_store": store,
        "replay_store": replay_store,
        "allow_mismatch": allow_mismatch,
        "init_from": start or None,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return out


def train_one(
    store: str,
    name: str,
    seed: int,
    steps: int,
    run_dir: Path,
    env: dict,
    fixed: dict | None = None,
    init_from: str = "",
    processes: int = 1,
) -> float:
    """Train one (recipe, seed) into run_dir (from scratch, or from the checkpoint init_from) -> seconds taken.
    processes > 1: as that many DDP processes, each with its share of the rows, each rank auditing what it did."""
    if run_dir.exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    fields = per_process({**(fixed or FIXED), **recipe_flags(name)}, processes)
    t0 = time.time()
    train = [
        *launcher(processes),
        str(ROOT / "train.py"),
        "--store",
        store,
        "--out",
        str(run_dir),
        "--max-steps",
        str(steps),
        "--seed",
        str(seed),
        *argv(fields),
    ]
    train += ["--init-from", init_from] if init_from else []
    train += ["--audit"] if processes > 1 else []  # every rank's world size, checked by world_size()
    _call(train, env, run_dir.parent / f"s{seed}.train.log")
    return time.time() - t0


def _call(cmd: list[str], env: dict, log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        r = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd[:2])} failed (exit {r.returncode}); see {log}")


def collect(
    store: str,
    name: str,
    seed: int,
    steps: int,
    flags: dict,
    run_dir: Path,
    report: Path,
    train_s: float,
    fixed: dict | None = None,
) -> dict:
    from store.hidden_store import HiddenStore
    from store.shard_reader import ShardReader

    fixed = fixed or FIXED
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    train = [r for r in records if r["split"] == "train"]
    final = [r for r in records if r["split"] == "eval"][-1]
    config = json.loads((run_dir / "final" / "config.json").read_text())["dflash_pipeline"]["train_config"]
    rep = json.loads((report / "report.json").read_text())["checkpoints"][0]
    hs = HiddenStore(store)
    eos, readers = set(hs.attrs.eos_token_ids), {}
    prompts = []
    for p in rep["per_prompt"]:
        reader = readers.setdefault(p["shard"], ShardReader(hs, p["shard"]))
        ended = int(reader.tokens(p["index"])[-1]) in eos
        prompts.append(
            {
                "shard": p["shard"],
                "index": p["index"],
                "completion_len": p["completion_len"],
                "eos": ended,
                "tau": p["tau"],
                "tau_t1": p.get("tau_at_temperature"),
                "ddtree": p["ddtree"],
            }
        )
    return {
        "recipe": name,
        "seed": seed,
        "steps": steps,
        "flags": flags,
        "fixed": fixed,
        "train_config": config,
        "train_seconds": round(train_s, 1),
        "s_per_step": (train[-1]["time"] - train[0]["time"]) / (train[-1]["step"] - train[0]["step"]),
        "blocks_per_step": statistics.mean(r["blocks"] for r in train) / fixed["log_every"],
        "heldout_loss": final["loss"],
        "heldout_ce": final.get("ce"),
        "heldout_tau_streak": final["tau_streak"],
        "train_tau_replay": final.get("tau_replay"),
        "tau": rep["tau"],
        "tau_ci95": rep["tau_ci95"],
        "tau_pooled": rep["tau_pooled"],
        **at_temperature(rep),
        "ddtree16": rep["ddtree"].get("16"),  # None: chain only (a dspark drafter)
        "ddtree64": rep["ddtree"].get("64"),
        "check": rep["check"],
        "prompts": prompts,
    }


def at_temperature(rep: dict) -> dict:
    """tau@1 (tau_t1), its lower bound (tau_t1_low) and greedy drafts verified at T=1 (tau_t1_greedy) from
    evaluate.py's report (its tau_at_temperature); None each when the replay had no temperature."""
    t = rep.get("tau_at_temperature") or {}
    return {"tau_t1": t.get("tau"), "tau_t1_low": t.get("tau_low"), "tau_t1_greedy": t.get("tau_greedy_drafts")}


def markdown(t: dict) -> str:
    cols = [
        ("tau", "chain tau"),
        ("tau_pooled", "pooled"),
        ("tau_t1", "tau@1"),
        ("tau_t1_low", "tau@1 lower bound"),
        ("tau_t1_greedy", "tau@1, greedy drafts"),
        ("ddtree16", "DDTree-16"),
        ("ddtree64", "DDTree-64"),
        ("tau_eos", "tau, EOS-ended"),
        ("tau_cut", "tau, cut"),
        ("heldout_ce", "held-out CE"),
        ("s_per_step", "s/step"),
    ]
    head = " | ".join(c for _, c in cols)
    lines = [
        f"| recipe ({t['steps']} steps) | seeds | {head} | chain tau vs {t['against']} | EOS-ended vs {t['against']} |",
        "|" + " --- |" * (len(cols) + 4),
    ]
    for name, row in t["recipes"].items():
        cells = []
        for k, _ in cols:
            m, sd = row[k]["mean"], row[k]["sd"]
            cells.append("-" if m is None else f"{m:.3f}" + (f" ± {sd:.3f}" if sd is not None else ""))
        vs = [versus(row[k].get("paired"), name == t["against"]) for k in ("tau", "tau_eos")]
        lines.append(f"| {name} | {len(row['seeds'])} | " + " | ".join(cells + vs) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = harness.subcommand(sub, "run", "train and replay (recipe, seed) runs not kept yet")
    r.add_argument("--store", required=True)
    r.add_argument("--recipes", required=True, help="comma-separated names of RECIPES, 'a+b' combinations, or default")
    r.add_argument("--seeds", default="0,1,2")
    r.add_argument("--steps", type=int, default=200)
    r.add_argument("--jobs", type=int, help="runs at once [default: 2 // --processes, at least 1: two cores]")
    r.add_argument(
        "--processes",
        type=int,
        default=1,
        help="train each drafter as this many DDP processes on CPU, the rows a step split between them "
        "(kept as RECIPE@p2)",
    )
    r.add_argument("--runs", default="/tmp/recipe_bench", help="where run directories go (large; not kept)")
    r.add_argument("--results", default=str(RESULTS))
    r.add_argument("--replay-store", help="replay on this store of the same prompts (default: --store)")
    r.add_argument("--train-tag", default="", help="names the training store: runs are kept as RECIPE@TAG")
    r.add_argument(
        "--allow-mismatch",
        action="store_true",
        help="replay on a --replay-store whose conditioning "
        "differs from the training store's (evaluate.py --allow-mismatch; the result records it)",
    )
    r.add_argument("--label", default="", help="results are kept as RECIPE@LABEL (default: --train-tag)")
    r.add_argument(
        "--init-from",
        default="",
        help="start every run from this drafter checkpoint (train.py "
        "--init-from; '{seed}' in it is the run's seed) instead of from scratch; needs --label",
    )
    t = harness.subcommand(sub, "table", "summarize the kept runs of one budget")
    t.add_argument("--steps", type=int, default=200)
    t.add_argument("--against", default="baseline")
    t.add_argument("--results", default=str(RESULTS))
    t.add_argument("--only", help="comma-separated kept results to list (RECIPE or RECIPE@LABEL), besides --against")
    args = harness.parse(ap)
    if args.toy and args.cmd == "run":
        FIXED.update(TOY_FIXED)
    if args.cmd == "run":
        names = args.recipes.split(",")
        for n in names:
            recipe_flags(n)  # unknown names fail before anything runs
        if args.init_from and not args.label:
            ap.error("--init-from needs --label: its runs are not from scratch")
        if args.processes < 1:
            ap.error(f"--processes: expected at least 1, got {args.processes}")
        for n in names:
            try:
                per_process({**FIXED, **recipe_flags(n)}, args.processes)
            except ValueError as e:
                ap.error(f"{n}: {e}")
        jobs = [(n, int(s)) for n in names for s in args.seeds.split(",")]
        with ThreadPoolExecutor(args.jobs or max(1, 2 // args.processes)) as pool:
            futures = [
                pool.submit(
                    one_run,
                    args.store,
                    n,
                    s,
                    args.steps,
                    Path(args.runs),
                    Path(args.results),
                    args.replay_store,
                    args.train_tag,
                    args.label,
                    args.allow_mismatch,
                    init_from=args.init_from,
                    processes=args.processes,
                )
                for n, s in jobs
            ]
            kept = {f"{n} seed {s}": str(f.result()) for (n, s), f in zip(jobs, futures)}
        harness.emit({"runs": kept}, args)
        return
    result = table(Path(args.results), args.steps, args.against, args.only.split(",") if args.only else None)
    print(markdown(result))
    harness.emit(result, args)


if __name__ == "__main__":
    main()
