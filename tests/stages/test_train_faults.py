"""Training killed with SIGKILL at every kind of moment, checkpoint writes included: a rerun with
--resume continues from the last complete checkpoint and gives the uninterrupted run's losses step
for step and its final weights bit for bit; a partial checkpoint is never picked up."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.drafter import checkpoint
from tests.conftest import REPO
from tests.processes import TINY, losses, train

COMMON = ["--max-steps", 12, "--save-every", 4, "--keep-last", 2, "--eval-every", 4, "--noise-std", 0.05, *TINY]
POINTS = ["step:3", "step:7", "training-state:4", "trainer-index:4", "weights:8", "publish:8", "prune:8", "final"]


def evals(out) -> list[tuple[int, float]]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in recs if r["split"] == "eval"]


def killed(args, point) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "tests.killed", "train", point, *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


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


@pytest.mark.parametrize("gone", ["states", "shard"])
def test_a_shard_deleted_under_a_running_trainer_stops_it_naming_the_shard_or_is_skipped(
    small_store, tmp_path, monkeypatch, gone
):
    """At step 3 of 14, shard 1's state file (or the whole shard, commit file first) is deleted while a
    DataLoader worker reads ahead: no batch is built from what is missing."""
    import shutil

    from stages.train import run as train_module
    from stages.train.config import TrainConfig
    from store.errors import StoreError

    real, step_at = train_module.train_step, {}

    def deleting(s, config, batches, step, seen):
        if step == 2 and not step_at:
            store = config.data.store
            step_at["deleted"] = step
            if gone == "states":
                for chunk in Path(f"{store}/shards/00001/hidden").glob("c.*"):  # format revision 5's chunk files
                    chunk.unlink()
            else:
                os.remove(f"{store}/_commits/00001.json")
                shutil.rmtree(f"{store}/shards/00001")
        return real(s, config, batches, step, seen)

    monkeypatch.setattr(train_module, "train_step", deleting)
    names = "is missing" if gone == "states" else "_commits/00001.json: gone since the run started"
    for on_corrupt in ("stop", "skip"):
        step_at.clear()
        store = tmp_path / f"{on_corrupt}.zarr"
        shutil.copytree(small_store, store)
        config = TrainConfig.of(
            store=str(store),
            out=str(tmp_path / on_corrupt),
            shards="0-2",
            eval_shards="3",
            max_steps=14,
            batch_size=2,
            anchors=4,
            workers=1,
            on_corrupt=on_corrupt,
        )
        if on_corrupt == "stop":
            with pytest.raises(StoreError) as e:
                train_module.run(config, log=lambda m: None)
            text = str(e.value)
            assert names in text and "--shards 1 --redo" in text and "\n" not in text, text
            assert not (tmp_path / "stop" / "final").exists()
        else:
            summary = train_module.run(config, log=lambda m: None)
            assert step_at == {"deleted": 2} and summary["corrupt_skipped"] > 0
