"""Random faults (opt-in: `pytest -m faults tests/test_faults.py`): `pipeline extract` and `train.py`
killed with SIGKILL at random moments and run again must give what an uninterrupted run gives; a store's
files damaged at random must each read back, as training and evaluation read them, as an error naming the
file or as the data unchanged.

tests/test_processes.py and tests/stages/test_train_faults.py kill at chosen points and
tests/store/test_damage.py damages every file in six fixed ways; these pick the moments and the damage at
random. DFLASH_FAULT_SEED (default 0) seeds them, so a failure is replayed by its seed and test id;
DFLASH_FAULT_KILLS (default 3: kills of each command) and DFLASH_FAULT_DAMAGE (default 60) set how many.
The counts that ran before this file (20 extraction kills, 10 training kills, 500 damages: all identical,
every damage named or harmless) are in bench/results/faults.json.

Extraction: shards 0-3 of the shipped prompt set's 64 into a fresh store, killed after a random delay within one
uninterrupted run's wall time (from half its start-up: most kills land in the work, not in the
imports), then run to completion; every file under shards/ must be byte-identical to
the uninterrupted store's, and the commit records' counts and checksums the same. Training: 30 steps saved
every 5 on that store, killed the same way, then run again with --resume: the train losses must be the
uninterrupted ones step for step, and final/ the same tensors. One thread per process.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.processes import TINY, losses, pipeline_proc

pytestmark = pytest.mark.faults

SEED = int(os.environ.get("DFLASH_FAULT_SEED", "0"))
KILLS = int(os.environ.get("DFLASH_FAULT_KILLS", "3"))
DAMAGE = int(os.environ.get("DFLASH_FAULT_DAMAGE", "60"))
EXTRACT = [
    "--shards",
    "0-3",
    "--num-shards",
    "64",
    "--max-new-tokens",
    "32",
    "--max-length",
    "256",
    "--batch-size",
    "4",
    "--chunk-tokens",
    "64",
    "--shard-tokens",
    "256",
]  # of the shipped prompt set
TRAIN = [
    "--max-steps",
    "30",
    "--save-every",
    "5",
    "--keep-last",
    "2",
    "--eval-shards",
    "3",
    "--noise-std",
    "0.05",
    *TINY,
]


def rng(kind: str, i: int) -> random.Random:
    return random.Random(f"{SEED}-{kind}-{i}")


def train_proc(args: list) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "train.py", *map(str, args)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(p: subprocess.Popen) -> None:
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]


def window(p: subprocess.Popen, first_output) -> tuple[float, float]:
    """Run p to its end: the window kills are drawn from, (half the seconds from its start to its
    first output, first_output() giving that output's wall-clock time; 0.9 of its wall seconds), so
    most land in the work rather than the imports, and before the end on a machine a little faster."""
    t0 = time.time()
    finish(p)
    return 0.5 * (first_output() - t0), 0.9 * (time.time() - t0)


def kill_after(p: subprocess.Popen, delay: float) -> bool:
    """SIGKILL p after delay seconds; True if it was killed (not already done)."""
    try:
        p.communicate(timeout=delay)
        return False
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGKILL)
        p.communicate()
        return True


def shard_files(store: Path) -> dict[str, bytes]:
    return {str(f.relative_to(store)): f.read_bytes() for f in sorted((store / "shards").rglob("*")) if f.is_file()}


def commits(store: Path) -> dict[str, dict]:
    keep = ("shard", "samples", "tokens", "completion_tokens", "skipped", "truncated", "shapes", "checksums")
    return {
        f.name: {k: v for k, v in json.loads(f.read_text()).items() if k in keep}
        for f in sorted((store / "_commits").glob("0*.json"))
    }


def final_tensors(out: Path) -> dict:
    from pipeline.drafter import checkpoint

    return checkpoint.load(out / "final")[1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted extraction: (its store, its argument list's maker, the window to kill it in)."""
    store = tmp_path_factory.mktemp("faults") / "ref.zarr"
    args = lambda path: ["extract", "--store", str(path), *EXTRACT]  # noqa: E731
    first = lambda: min(f.stat().st_mtime for f in (store / "_commits").glob("0*.json"))  # noqa: E731
    return store, args, window(pipeline_proc(args(store)), first)


@pytest.fixture(scope="module")
def train_reference(reference, tmp_path_factory):
    """An uninterrupted training run on the reference store: (its out, the window to kill it in)."""
    out = tmp_path_factory.mktemp("faults") / "train-ref"

    def first():
        return min(r["time"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "time" in r)

    return out, window(train_proc(["--store", reference[0], "--out", out, *TRAIN]), first)


@pytest.mark.parametrize("i", range(KILLS))
def test_extraction_killed_at_random_then_rerun_is_identical(reference, tmp_path, i):
    ref, args, (start, wall) = reference
    store = tmp_path / "x.zarr"
    delay = rng("extract", i).uniform(start, wall)
    killed = kill_after(pipeline_proc(args(store)), delay)
    committed = len(list((store / "_commits").glob("0*.json"))) if store.exists() else 0
    print(f"extraction {'killed' if killed else 'done'} after {delay:.1f}s (window to {wall:.1f}s), ", end="")
    print(f"{committed} shards committed")
    finish(pipeline_proc(args(store)))
    assert commits(store) == commits(ref), f"seed {SEED}, killed after {delay:.2f}s"
    assert shard_files(store) == shard_files(ref), f"seed {SEED}, killed after {delay:.2f}s"


@pytest.mark.parametrize("i", range(KILLS))
def test_training_killed_at_random_then_resumed_is_identical(reference, train_reference, tmp_path, i):
    import torch

    ref, (start, wall) = train_reference
    out = tmp_path / "run"
    args = ["--store", reference[0], "--out", out, *TRAIN]
    delay = rng("train", i).uniform(start, wall)
    killed = kill_after(train_proc(args), delay)
    steps = len(losses(out)) if (out / "metrics.jsonl").exists() else 0
    print(f"training {'killed' if killed else 'done'} after {delay:.1f}s (window to {wall:.1f}s), {steps} steps logged")
    if not (out / "final" / "config.json").exists():  # else the kill came after the run was done
        finish(train_proc([*args, "--resume"] if out.exists() else args))
    assert losses(out) == losses(ref), f"seed {SEED}, killed after {delay:.2f}s"
    want, got = final_tensors(ref), final_tensors(out)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want), f"seed {SEED}, killed after {delay:.2f}s"


@pytest.fixture(scope="module")
def damage_target(reference, tmp_path_factory):
    """A copy of the reference store, what reading all of it gives, and its files."""
    from tests.store.test_damage import files, read_everything

    store = tmp_path_factory.mktemp("faults") / "damaged.zarr"
    shutil.copytree(reference[0], store)
    return store, read_everything(str(store), [0, 1, 2, 3]), files(store)


def random_damage(original: bytes, r: random.Random) -> tuple[str, bytes | None]:
    """1-64 bytes flipped at a random place, cut at a random length, or deleted (None)."""
    kind = r.choice(["flip", "cut", "delete"])
    if kind == "flip" and original:
        at, length = r.randrange(len(original)), r.randint(1, 64)
        flipped = bytes(b ^ r.randint(1, 255) for b in original[at : at + length])
        return kind, original[:at] + flipped + original[at + length :]
    if kind == "cut" and original:
        return kind, original[: r.randrange(len(original))]
    return kind, None


@pytest.mark.parametrize("i", range(DAMAGE))
def test_random_damage_is_an_error_naming_the_file_or_changes_nothing(damage_target, i):
    from store.errors import StoreError
    from tests.store.test_damage import equal, names, read_everything

    store, clean, keys = damage_target
    r = rng("damage", i)
    key = r.choice(keys)
    path = store / key
    original = path.read_bytes()
    kind, bad = random_damage(original, r)
    path.unlink() if bad is None else path.write_bytes(bad)
    try:
        got = read_everything(str(store), [0, 1, 2, 3])
    except StoreError as e:
        assert names(str(e), key) and "\n" not in str(e), f"seed {SEED}: {key} {kind}: {e}"
    else:
        assert equal(got, clean), f"seed {SEED}: {key} {kind}: read as data"
    finally:
        path.write_bytes(original)
