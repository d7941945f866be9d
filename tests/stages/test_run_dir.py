"""Checkpoint pruning (--keep-last): which step-N directories a run deletes, and that a pruned run
still resumes exactly."""

import itertools
import json
import random

import pytest
import torch

from pipeline.drafter import checkpoint
from stages.train.run_dir import complete_steps, latest_step, prune_steps
from store.errors import ConfigError
from tests.modes import file_modes, umask
from tests.processes import TINY, losses, train


def step_dir(out, n, complete=True):
    d = out / f"step-{n}"
    (d / "training").mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"x" * 10)
    if complete:
        (d / "trainer_state.json").write_text(json.dumps({"step": n}))
    return d


def names(out) -> set[str]:
    return {p.name for p in out.iterdir()}


def test_prune_keeps_the_newest_and_everything_not_an_older_step(tmp_path):
    for n in (1, 2, 3, 4, 5, 7):  # step-7: a run that went further, before this one resumed earlier
        step_dir(tmp_path, n)
    step_dir(tmp_path, 0, complete=False)  # no trainer_state.json: not ours to judge
    for other in ("final", "step-best", ".step-3.tmp", ".step-9.tmp"):
        (tmp_path / other).mkdir()
    (tmp_path / "metrics.jsonl").write_text("")
    deleted = prune_steps(tmp_path, 5, keep=2)
    assert sorted(p.name for p in deleted) == ["step-1", "step-2", "step-3"]
    assert names(tmp_path) == {
        "step-0",
        "step-4",
        "step-5",
        "step-7",
        "final",
        "step-best",
        ".step-9.tmp",
        "metrics.jsonl",
    }  # .step-3.tmp: a crashed save of an older step


def test_keep_last_zero_deletes_nothing(tmp_path):
    for n in (1, 2, 3):
        step_dir(tmp_path, n)
    (tmp_path / ".step-1.tmp").mkdir()
    before = names(tmp_path)
    assert prune_steps(tmp_path, 3, keep=0) == [] and names(tmp_path) == before


def test_resume_source_stays_until_a_newer_checkpoint_is_complete(tmp_path):
    """A run resumed from step-3 (explicitly, keeping one) prunes only after publishing step-4; at
    step-3 itself nothing older than the source exists to delete, and the source is the newest."""
    source = step_dir(tmp_path, 3)
    step_dir(tmp_path, 2)
    prune_steps(tmp_path, 3, keep=1)
    assert source.exists() and not (tmp_path / "step-2").exists()
    step_dir(tmp_path, 4, complete=False)  # being written: not yet a checkpoint
    assert complete_steps(tmp_path)[-1][1] == source
    (tmp_path / "step-4" / "trainer_state.json").write_text("{}")
    prune_steps(tmp_path, 4, keep=1)
    assert not source.exists() and latest_step(tmp_path) == tmp_path / "step-4"


@pytest.mark.parametrize("seed", range(20))
def test_prune_properties_on_random_run_dirs(tmp_path, seed):
    """Whatever OUT holds: what --resume would use survives, final survives, and exactly
    min(keep, count) published checkpoints up to the newest remain."""
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(1, 40), rng.randint(1, 8)))
    for n in steps:
        step_dir(tmp_path, n)
    (tmp_path / "final").mkdir()
    newest, keep = rng.choice(steps), rng.randint(1, 4)
    latest = latest_step(tmp_path)
    prune_steps(tmp_path, newest, keep)
    assert latest.exists() and (tmp_path / "final").exists() and (tmp_path / f"step-{newest}").exists()
    left = [n for n, _ in complete_steps(tmp_path)]
    up_to = [n for n in steps if n <= newest]
    assert [n for n in left if n <= newest] == up_to[-keep:]
    assert [n for n in left if n > newest] == [n for n in steps if n > newest]


def test_a_crash_while_deleting_leaves_no_checkpoint_that_looks_complete(tmp_path, monkeypatch):
    import shutil

    for n in (1, 2, 3):
        step_dir(tmp_path, n)
    real = shutil.rmtree

    def crash(path, *a, **kw):
        if str(path).endswith(".step-1.tmp") and not kw.get("ignore_errors"):
            raise KeyboardInterrupt
        return real(path, *a, **kw)

    monkeypatch.setattr(shutil, "rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        prune_steps(tmp_path, 3, keep=1)
    assert [n for n, _ in complete_steps(tmp_path)] == [3]  # step-1, step-2 hidden before any file went
    monkeypatch.setattr(shutil, "rmtree", real)
    step_dir(tmp_path, 4)
    prune_steps(tmp_path, 4, keep=1)
    assert names(tmp_path) == {"step-4"}  # the next prune clears what the crash left


def test_keep_last_is_validated():
    from stages.train.config import TrainConfig

    with pytest.raises(ConfigError, match="--keep-last"):
        TrainConfig.of(keep_last=-1)
    assert TrainConfig().run.keep_last == 2


def test_pruned_run_keeps_the_newest_two_and_resumes_exactly(small_store, tmp_path):
    common = ["--store", small_store, "--max-steps", 6, "--save-every", 1, "--keep-last", 2, *TINY]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    r = train([*common, "--out", straight])
    assert r.returncode == 0, r.stderr
    assert names(straight) >= {"step-5", "step-6", "final"}
    assert not {n for n in names(straight) if "step" in n} - {"step-5", "step-6"}  # nor any hidden leftover
    r = train([*common, "--out", resumed], stop_after=4)
    assert r.returncode == 130, r.stderr
    assert {n for n in names(resumed) if "step" in n or n == "final"} == {"step-3", "step-4"}
    (resumed / ".step-2.tmp").mkdir()  # as a save that crashed would leave it
    r = train([*common, "--out", resumed, "--resume"])
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stderr and "step-4" in r.stderr
    assert losses(resumed) == losses(straight) and len(losses(straight)) == 6
    assert {n for n in names(resumed) if "step" in n} == {"step-5", "step-6"}
    a, b = checkpoint.load(straight / "final")[1], checkpoint.load(resumed / "final")[1]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert list(itertools.chain(straight.glob(".*"), resumed.glob(".*"))) == []


@pytest.mark.parametrize("mask, mode", [(0o022, "0644"), (0o077, "0600")])
def test_every_file_of_a_run_is_as_readable_as_the_umask_makes_files(small_store, tmp_path, mask, mode):
    """step-N/ (its trainer state too: every rank's file and DCP's index) and
    final/ are readable by a teammate or a serving engine exactly as far as the user's umask allows."""
    with umask(mask):  # the training process inherits it
        r = train(
            [
                "--store",
                small_store,
                "--out",
                tmp_path / "run",
                "--max-steps",
                2,
                "--save-every",
                2,
                "--eval-shards",
                "3",
                *TINY,
            ]
        )
    assert r.returncode == 0, r.stderr
    modes = file_modes(tmp_path / "run")
    assert {
        "step-2/model.safetensors",
        "step-2/training/__0_0.distcp",
        "step-2/training/.metadata",
        "final/model.safetensors",
        "metrics.jsonl",
    } <= set(modes)
    assert {f: m for f, m in modes.items() if m != mode} == {}


def test_field_roles_come_from_the_settings():
    """What a resume must keep and which flags size the drafter are said where each field is made
    (setting(..., resume=, drafter=)): the run's own output and worker count may change on resume, and
    every drafter role names a DrafterConfig field."""
    import dataclasses

    from pipeline.drafter.config import DrafterConfig
    from stages.settings import with_role
    from stages.train.config import TrainConfig
    from stages.train.run_dir import RESUME_FIXED

    assert {"store", "lr", "seed", "batch_size", "schedule"} <= set(RESUME_FIXED)
    assert not {"out", "workers", "resume", "save_every", "grad_checkpoint"} & set(RESUME_FIXED)
    roles = with_role(TrainConfig, "drafter")
    assert roles["num_layers"] == "num_hidden_layers" and len(roles) == 8  # with head, markov_rank (dspark)
    assert set(roles.values()) <= {f.name for f in dataclasses.fields(DrafterConfig)}
