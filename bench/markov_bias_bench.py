"""How much of a DSpark drafter's tau its Markov transition head carries at decode.

Each checkpoint (a `--head dspark` drafter, such as a recipe bench run's RUN/final) is replayed on the
store's held-out shards three times, with the recipe bench's replay flags (chain, fp32, and tau at T=1
on a store with final states):
- `with`: as it is;
- `without`: its `markov_head.markov_w2` zeroed. The head's bias is then zero, so every slot drafts the
  backbone's own argmax, as a DFlash drafter does;
- `constant`: every row of `markov_w1` replaced by their mean weighted by how often each token occurs in
  the training shards. Every slot then gets the same bias, the head's average, whatever token precedes
  it: what is left is the head without its dependence on the previous token.
`with` - `without` is what the head adds at decode to the backbone trained beside it; `with` -
`constant` is what the previous token adds. What a drafter trained without the head reaches is
another question, the recipe bench's (`dspark` paired against `default`).

    python -m bench.markov_bias_bench --store /work/bench/hs-final.zarr --seeds 0,1,2 \\
        --checkpoints '/work/bench_runs/1000/default+dspark+soft-tv@fs-epyc/s{seed}/final' \\
        --json bench/results/markov_bias_cpu.json

Per seed: chain tau, tau@1 and its lower bound of each variant; then the paired differences from
`with` over the seeds, with their 95% t-intervals. --toy trains a 2-step dspark drafter on shards 0-2
of --store and replays its shard 3.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from bench import harness
from bench.recipe_bench import REPLAY, TOY_FIXED, at_temperature, replay_flags, temperature_flags
from recipe_results import FIXED, paired

TOY = [["--store", "{store}"]]
FIGURES = ("tau", "tau_t1", "tau_t1_low")
VARIANTS = ("without", "constant")
MARKOV_W1, MARKOV_W2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"


def token_counts(store: str, shards: str, vocab: int):
    """[vocab] float64: how often each token occurs in the shards' samples (prompt and completion)."""
    import numpy as np

    from store.format.ranges import parse_ranges
    from store.hidden_store import HiddenStore
    from store.shard_reader import ShardReader

    hs, counts = HiddenStore(store), np.zeros(vocab)
    for shard in parse_ranges(shards):
        reader = ShardReader(hs, shard)
        for i in range(len(reader)):
            counts += np.bincount(reader.tokens(i), minlength=vocab)
    return counts


def ablated(checkpoint: Path, out: Path, variant: str, counts) -> Path:
    """A copy of the checkpoint with its Markov head ablated (every other file as it is) -> its directory.
    variant: 'without' (markov_w2 zeroed) or 'constant' (markov_w1's rows all their mean weighted by counts)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, out)
    t = load_file(out / "model.safetensors")
    if variant == "without":
        t[MARKOV_W2] = torch.zeros_like(t[MARKOV_W2])
    else:
        w1 = t[MARKOV_W1]  # [V, r]
        mean = torch.as_tensor(counts / counts.sum(), dtype=torch.float64) @ w1.double()  # [r]
        t[MARKOV_W1] = mean.to(w1.dtype).expand_as(w1).contiguous()
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    return out


def replay(store: str, checkpoint: Path, shards: str, report: Path) -> dict:
    """evaluate.py on the held-out shards with the recipe bench's flags -> {figure: value}."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = harness.python(str(harness.REPO / "evaluate.py"), "--store", store, "--checkpoint", str(checkpoint))
    cmd += ["--out", str(report), "--shards", shards, *replay_flags({"head": "dspark"}), *temperature_flags(store)]
    r = subprocess.run(cmd, env=env, cwd=harness.REPO, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"evaluate.py failed on {checkpoint}: {r.stderr[-2000:]}")
    rep = json.loads((report / "report.json").read_text())["checkpoints"][0]
    t = at_temperature(rep)  # the recipe bench's names for evaluate.py's tau_at_temperature
    return {"tau": rep["tau"], "tau_t1": t["tau_t1"], "tau_t1_low": t["tau_t1_low"]}


def toy_checkpoint(store: str, tmp: Path) -> Path:
    """A dspark drafter trained for 2 steps on the toy shards (--toy only)."""
    cmd = harness.python(str(harness.REPO / "train.py"), "--store", store, "--out", str(tmp / "run"))
    cmd += ["--max-steps", "2", "--head", "dspark", "--shards", TOY_FIXED["shards"]]
    cmd += ["--eval-shards", TOY_FIXED["eval_shards"], "--threads", "1", "--workers", "1"]
    subprocess.run(cmd, cwd=harness.REPO, check=True, capture_output=True)
    return tmp / "run" / "final"


def with_minus(rows: list[dict], variant: str, figure: str) -> dict:
    """with - variant over the seeds that have the figure (recipe_results.paired: relative to the variant's mean)."""
    rows = [r for r in rows if r["with"][figure] is not None]
    if not rows:
        return {"diff": None, "ci95": None, "relative": None}
    diffs = [r["with"][figure] - r[variant][figure] for r in rows]
    return paired(diffs, statistics.mean(r[variant][figure] for r in rows))


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--store", required=True)
    p.add_argument("--checkpoints", help="a drafter checkpoint; '{seed}' in it is filled in per seed")
    p.add_argument("--seeds", default="0")
    args = harness.parse(p)
    if not args.toy and not args.checkpoints:
        p.error("--checkpoints is required (a dspark drafter checkpoint; '{seed}' in it is filled in per seed)")
    fixed = TOY_FIXED if args.toy else FIXED
    shards, rows, counts = fixed["eval_shards"], [], None
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for seed in [int(s) for s in args.seeds.split(",")]:
            ckpt = toy_checkpoint(args.store, tmp) if args.toy else Path(args.checkpoints.format(seed=seed))
            if counts is None:
                vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
                counts = token_counts(args.store, fixed["shards"], vocab)
            row = {
                "seed": seed,
                "checkpoint": str(ckpt),
                "with": replay(args.store, ckpt, shards, tmp / f"s{seed}-with"),
            }
            for v in VARIANTS:
                drafter = ablated(ckpt, tmp / f"s{seed}-{v}-drafter", v, counts)
                row[v] = replay(args.store, drafter, shards, tmp / f"s{seed}-{v}")
            rows.append(row)
    result = {"store": args.store, "shards": shards, "weights_from": fixed["shards"], "replay": REPLAY, "runs": rows}
    harness.emit(result | {f"with_minus_{v}": {f: with_minus(rows, v, f) for f in FIGURES} for v in VARIANTS}, args)


if __name__ == "__main__":
    main()
