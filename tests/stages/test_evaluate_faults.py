"""evaluate.py killed with SIGKILL in the middle of the replay or while writing its report: no
half report is ever left, and a rerun writes the report of an uninterrupted run."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.stages.test_evaluate import our_checkpoint

VOLATILE = ("time", "replay_seconds", "rounds_per_s")  # wall-clock figures


def evaluate(args, point=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    program = ["evaluate.py"] if point is None else ["-m", "tests.killed", "evaluate", point]
    return subprocess.run(
        [sys.executable, *program, *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def stable(report_dir) -> dict:
    rep = json.loads((report_dir / "report.json").read_text())

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in VOLATILE}
        return [strip(v) for v in x] if isinstance(x, list) else x

    return strip(rep)


@pytest.mark.parametrize("point", ["replay:3", "report"])
def test_sigkill_leaves_no_half_report_and_a_rerun_equals_uninterrupted(small_store, tmp_path, point):
    ck = our_checkpoint(small_store, tmp_path / "ck")
    common = ["--store", small_store, "--checkpoint", ck, "--ddtree", "4", "--shards", "0-3", "--batch-prompts", 2]
    r = evaluate([*common, "--out", tmp_path / "straight"])
    assert r.returncode == 0, r.stderr
    r = evaluate([*common, "--out", tmp_path / "killed"], point)
    assert r.returncode == -9, r.stderr
    assert not (tmp_path / "killed" / "report.json").exists()
    r = evaluate([*common, "--out", tmp_path / "killed"])
    assert r.returncode == 0, r.stderr
    assert stable(tmp_path / "killed") == stable(tmp_path / "straight")
    assert not list((tmp_path / "killed").glob(".*.tmp*"))  # what the killed write left is gone


DAMAGE = {  # file -> what is done to it (tests/store/test_damage.py does every file, every kind, in-process)
    "_commits/00003.json": "flip",
    "shards/00003/offsets/c.0": "delete",
    "shards/00003/tokens/zarr.json": "cut",
    "shards/00003/hidden/c.0.0.0": "flip-end",  # the shard index
    "zarr.json": "digit",  # the root attributes
    "target/lm_head/c.0.0": "delete",
}


@pytest.mark.parametrize("key", DAMAGE)
def test_train_and_evaluate_name_a_damaged_file_in_one_line(small_store, tmp_path, key):
    import shutil

    from tests.processes import TINY, train
    from tests.store.test_damage import damaged, names

    store = tmp_path / "hs.zarr"
    shutil.copytree(small_store, store)
    ck = our_checkpoint(small_store, tmp_path / "ck")
    path = store / key
    bad = damaged(path.read_bytes(), DAMAGE[key])
    path.unlink() if bad is None else path.write_bytes(bad)
    for r in (
        train(["--store", store, "--out", tmp_path / "run", "--max-steps", 2, "--eval-shards", 3, *TINY]),
        evaluate(["--store", store, "--checkpoint", ck, "--shards", 3, "--out", tmp_path / "rep"]),
    ):
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and lines[-1].startswith("error: ") and names(lines[-1], key), r.stderr[-2000:]
        assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "run" / "final").exists() and not (tmp_path / "rep" / "report.json").exists()
