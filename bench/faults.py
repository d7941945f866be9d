"""Random SIGKILLs: `pipeline extract` and `train.py` killed at random moments, then rerun; each
result must equal an uninterrupted run's. Random damage: a store's files damaged at random, each
read back as training and evaluation read it; each must be an error naming the file, or the data
unchanged.

    python bench/faults.py [--extract-kills 20] [--train-kills 10] [--damage 500] [--seed 0]
                           [--json bench/results/faults.json]

Extraction: shards 0-3 of the shipped prompt set (64 shards) into a fresh store, killed after a
random delay within one uninterrupted run's wall time, then rerun to completion; every file under
shards/ must be byte-identical to the uninterrupted store's, and the commit records' counts and
checksums the same. Training: 60 steps saved every 10 on that store, killed the same way, then rerun
with --resume; the train losses must be the uninterrupted ones step for step, and final/ the same
tensors. The tests (tests/test_processes.py, tests/stages/test_train_faults.py) kill at chosen
points; this bench kills at random ones. One thread per process, so results are comparable.
Damage: a random file of that store (any kind: commit files, metadata, every array's chunks, the
root), then at random: 1-64 bytes flipped at a random place, cut at a random length, or deleted;
tests/store/test_damage.py does every file in six fixed ways.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

EXTRACT = ["--shards", "0-3", "--num-shards", "64", "--max-new-tokens", "32", "--max-length", "256",
           "--batch-size", "4", "--chunk-tokens", "64", "--shard-tokens", "256"]
TRAIN = ["--max-steps", "60", "--save-every", "10", "--keep-last", "2", "--batch-size", "2", "--anchors", "16",
         "--num-layers", "1", "--workers", "1", "--log-every", "1", "--noise-std", "0.05"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def finish(args: list[str]) -> float:
    t0 = time.perf_counter()
    p = start(args)
    _, err = p.communicate()
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed: {err.strip().splitlines()[-1:]}")
    return time.perf_counter() - t0


def kill_after(args: list[str], delay: float) -> bool:
    """Run args, SIGKILL it after delay seconds; True if it was killed (not already done)."""
    p = start(args)
    try:
        p.wait(timeout=delay)
        return False
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGKILL)
        p.wait()
        return True


def shard_files(store: Path) -> dict[str, bytes]:
    return {str(f.relative_to(store)): f.read_bytes() for f in sorted((store / "shards").rglob("*")) if f.is_file()}


def commits(store: Path) -> dict[str, dict]:
    keep = ("shard", "samples", "tokens", "completion_tokens", "skipped", "truncated", "shapes", "checksums")
    return {f.name: {k: v for k, v in json.loads(f.read_text()).items() if k in keep}
            for f in sorted((store / "_commits").glob("0*.json"))}


def train_losses(out: Path) -> list[float]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r["split"] == "train"]


def final_tensors(out: Path) -> dict:
    from pipeline.drafter import checkpoint

    return checkpoint.load(out / "final")[1]


def extract_kills(root: Path, n: int, rng: random.Random) -> list[dict]:
    ref = root / "ref.zarr"
    wall = finish(["-m", "pipeline", "extract", "--store", str(ref), *EXTRACT])
    want_files, want_commits = shard_files(ref), commits(ref)
    runs = []
    for i in range(n):
        store = root / f"x{i}.zarr"
        delay = rng.uniform(0.2, wall)
        args = ["-m", "pipeline", "extract", "--store", str(store), *EXTRACT]
        killed = kill_after(args, delay)
        committed = len(list((store / "_commits").glob("0*.json"))) if store.exists() else 0
        finish(args)
        same = shard_files(store) == want_files and commits(store) == want_commits
        runs.append({"delay_s": round(delay, 2), "killed": killed, "shards_committed_at_kill": committed, "same": same})
        print(f"extract kill {i + 1}/{n}: after {delay:.1f}s ({committed} shards committed) -> "
              f"{'identical' if same else 'DIFFERENT'}", flush=True)
        shutil.rmtree(store)
    return runs


def train_kills(root: Path, n: int, rng: random.Random) -> list[dict]:
    import torch

    store = root / "ref.zarr"
    ref = root / "train-ref"
    wall = finish(["train.py", "--store", str(store), "--out", str(ref), *TRAIN])
    want_losses, want = train_losses(ref), final_tensors(ref)
    runs = []
    for i in range(n):
        out = root / f"t{i}"
        delay = rng.uniform(0.2, wall)
        args = ["train.py", "--store", str(store), "--out", str(out), *TRAIN]
        killed = kill_after(args, delay)
        steps = len(train_losses(out)) if (out / "metrics.jsonl").exists() else 0
        if not (out / "final" / "config.json").exists():  # else the kill came after the run was done
            finish([*args, "--resume"] if out.exists() else args)
        got = final_tensors(out)
        same = train_losses(out) == want_losses and all(torch.equal(want[k], got[k]) for k in want)
        runs.append({"delay_s": round(delay, 2), "killed": killed, "steps_logged_at_kill": steps, "same": same})
        print(f"train kill {i + 1}/{n}: after {delay:.1f}s ({steps} steps logged) -> "
              f"{'identical' if same else 'DIFFERENT'}", flush=True)
        shutil.rmtree(out)
    return runs


def damage(root: Path, n: int, rng: random.Random) -> list[dict]:
    from store.errors import StoreError
    from tests.store.test_damage import equal, files, names, read_everything

    store = root / "ref.zarr"
    shards = [0, 1, 2, 3]
    clean = read_everything(str(store), shards)
    keys = files(store)
    runs = []
    for i in range(n):
        key = rng.choice(keys)
        path = store / key
        original = path.read_bytes()
        kind = rng.choice(["flip", "cut", "delete"])
        if kind == "flip" and original:
            at, length = rng.randrange(len(original)), rng.randint(1, 64)
            flipped = bytes(b ^ rng.randint(1, 255) for b in original[at:at + length])
            bad = original[:at] + flipped + original[at + length:]
        elif kind == "cut":
            bad = original[:rng.randrange(len(original))] if original else None
        else:
            bad = None
        path.unlink() if bad is None else path.write_bytes(bad)
        try:
            outcome = "unchanged" if equal(read_everything(str(store), shards), clean) else "READ AS DATA"
        except StoreError as e:
            outcome = "error naming it" if names(str(e), key) and "\n" not in str(e) else f"OTHER ERROR: {e}"
        except Exception as e:  # noqa: BLE001 - reported, never hidden
            outcome = f"CRASH: {type(e).__name__}: {e}"
        finally:
            path.write_bytes(original)
        runs.append({"file": key, "kind": kind, "outcome": outcome,
                     "same": outcome in ("unchanged", "error naming it")})
        if not runs[-1]["same"]:
            print(f"damage {i + 1}/{n}: {key} {kind} -> {outcome}", flush=True)
    print(f"damage: {n} reads of a damaged store: " + ", ".join(
        f"{sum(r['outcome'] == o for r in runs)} {o}" for o in ("error naming it", "unchanged")), flush=True)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--extract-kills", type=int, default=20)
    ap.add_argument("--train-kills", type=int, default=10)
    ap.add_argument("--damage", type=int, default=500, help="random damages of the store, each read back")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="dflash-faults-") as tmp:
        root = Path(tmp)
        result = {"extract": extract_kills(root, args.extract_kills, rng),
                  "train": train_kills(root, args.train_kills, rng),
                  "damage": damage(root, args.damage, rng)}
    for kind, runs in list(result.items())[:2]:
        killed = [r for r in runs if r["killed"]]
        print(f"{kind}: {sum(r['same'] for r in runs)} of {len(runs)} reruns identical "
              f"({len(killed)} really killed, {sum(r['same'] for r in killed)} of those identical)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if not all(r["same"] for runs in result.values() for r in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
