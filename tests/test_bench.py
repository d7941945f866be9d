"""Every bench script runs at toy size (`pytest -m bench`, opt-in): each module of bench/ that lists
argument lists in `TOY` is run with each, as `python -m bench.NAME --toy ARGS`, and must end with
status 0 having printed its result. Placeholders in the arguments: {store} (a copy of the small
store), {fp8_store}, {checkpoint} (a drafter trained on the small store), {tmp} (a fresh directory)."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.bench


def toy_runs() -> list[tuple[str, tuple[str, ...]]]:
    """(module, args) for every TOY entry of every bench module, read without importing them."""
    runs = []
    for path in sorted((REPO / "bench").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "TOY" for t in node.targets):
                runs += [(path.stem, tuple(args)) for args in ast.literal_eval(node.value)]
    return runs


def test_every_bench_script_lists_its_toy_runs():
    scripts = {p.stem for p in (REPO / "bench").glob("*.py")} - {"harness", "gpu_wheels", "latency_proxy", "__init__"}
    assert scripts <= {module for module, _ in toy_runs()}, "a bench script without TOY runs"


@pytest.mark.parametrize(("module", "args"), toy_runs(), ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_toy_run(module, args, small_store, fp8_store, trained_drafter, tmp_path):
    store = tmp_path / "store.zarr"
    shutil.copytree(small_store, store)
    (tmp_path / "tmp").mkdir()
    fill = {"store": store, "fp8_store": fp8_store, "checkpoint": trained_drafter, "tmp": tmp_path / "tmp"}
    argv = [sys.executable, "-m", f"bench.{module}", *[a.format(**fill) for a in args], "--toy"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.strip(), "printed no result"


def test_a_recipe_on_the_defaults_passes_only_its_own_fields():
    from recipe_results import BASELINE, recipe_flags

    assert recipe_flags("default") == {}
    assert recipe_flags("default+all-sliding") == {"layer_types": "sliding", "sliding_window": 2048}
    assert recipe_flags("default+accept-0.5+muon") == {"acceptance_weight": 0.5, "optimizer": "muon"}
    assert recipe_flags("all-sliding") == {**BASELINE, "layer_types": "sliding", "sliding_window": 2048}
    with pytest.raises(KeyError):
        recipe_flags("default+nonsense")


def test_force_replaces_an_earlier_result_and_nothing_else(store_copy, tmp_path):
    """--json PATH --force on a file that is no bench result (a store's, a run's, a report's, a checkpoint's, not
    JSON at all) or a directory is refused as the command line is read, without pointing at --force; an earlier
    result is replaced."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "notes.json").write_text("not json")
    (tmp_path / "old.json").write_text('{"median_s": 1}\n')
    refused = {
        store_copy / "zarr.json": f"lies inside the hidden-state store {store_copy}",
        run / "metrics.jsonl": "is a file of a training run",
        tmp_path / "notes.json": "is not JSON",
        tmp_path: "is a directory",
    }
    before = {p: p.read_bytes() for p in refused if p.is_file()}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for path, why in refused.items():
        r = subprocess.run(
            [sys.executable, "-m", "bench.extract_bench", "--json", str(path), "--force", "--toy"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2 and r.stderr.splitlines()[-1].endswith(
            f"error: argument --json: {path} {why}: --json writes a bench result, replacing only an earlier one; "
            "choose another path"
        ), r.stderr
    assert {p: p.read_bytes() for p in before} == before
    from bench import harness

    args = harness.parser(None).parse_args(["--json", str(tmp_path / "old.json"), "--force"])
    harness.emit({"median_s": 2}, args)
    assert json.loads((tmp_path / "old.json").read_text()) == {"median_s": 2}


def test_several_processes_split_a_steps_rows_and_are_kept_under_their_own_name():
    from bench.recipe_bench import per_process, world_tag
    from recipe_results import FIXED, recipe_flags

    assert per_process({**FIXED, **recipe_flags("grad-bf16")}, 2) | {"batch_size": 4} == {**FIXED, "grad_comm": "bf16"}
    assert per_process(FIXED, 2)["batch_size"] * 2 == FIXED["batch_size"] == per_process(FIXED, 1)["batch_size"]
    with pytest.raises(ValueError, match="do not split evenly"):
        per_process({**FIXED, **recipe_flags("packed")}, 2)  # one packed row a step
    assert [world_tag("", 1), world_tag("", 2), world_tag("fp8", 2), world_tag("fp8", 1)] == ["", "p2", "fp8-p2", "fp8"]
