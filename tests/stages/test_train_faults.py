"""Training killed with SIGKILL at every kind of moment, checkpoint writes included: a rerun with
--resume continues from the last complete checkpoint and gives the uninterrupted run's losses step
for step and its final weights bit for bit; a partial checkpoint is never picked up."""

import json
import os
import subprocess
import sys

import pytest
import torch

from pipeline.drafter import checkpoint
from tests.conftest import REPO
from tests.processes import TINY, losses, train

COMMON = ["--max-steps", 12, "--save-every", 4, "--keep-last", 2, "--eval-every", 4, "--noise-std", 0.05, *TINY]
POINTS = ["step:3", "step:7", "training-state:4", "weights:8", "publish:8", "prune:8", "final"]


def evals(out) -> list[tuple[int, float]]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in recs if r["split"] == "eval"]


def killed(args, point) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "tests.killed", "train", point, *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def straight(small_store, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    r = train(["--store", small_store, *COMMON, "--out", out, "--eval-shards", 3])
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.parametrize("point", POINTS)
def test_sigkill_then_resume_equals_uninterrupted(small_store, straight, tmp_path, point):
    out = tmp_path / "run"
    r = killed(["--store", small_store, *COMMON, "--out", out, "--eval-shards", 3], point)
    assert r.returncode == -9, r.stderr  # really killed, at the point asked for
    r = train(["--store", small_store, *COMMON, "--out", out, "--eval-shards", 3, "--resume"])
    assert r.returncode == 0, r.stderr
    assert losses(out) == losses(straight)
    assert evals(out) == evals(straight)  # each validation once, with the same loss
    a, b = checkpoint.load(straight / "final")[1], checkpoint.load(out / "final")[1]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith((".step", ".final"))) == []
