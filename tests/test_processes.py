"""Real processes: SIGKILL mid-shard then resume, two writers at once, overlapping ranges, ranks
under torchrun (and killed mid-shard, then rerun with another world size)."""

import signal
import time

import psutil
import pytest

from store.hidden_store import HiddenStore
from tests.conftest import assert_stores_equal
from tests.processes import cli_args, pipeline_proc, run_pipeline


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_dataset):
    """Shards 0-3 in one uninterrupted process."""
    path = tmp_path_factory.mktemp("ref") / "hs.zarr"
    p = run_pipeline(cli_args(path, small_dataset, "0-3"))
    assert p.returncode == 0, p.stderr
    return path


def test_sigkill_mid_shard_then_rerun_equals_uninterrupted(tmp_path, small_dataset, reference):
    path = tmp_path / "hs.zarr"
    args = cli_args(path, small_dataset, "0-3")
    # Shard 0 (2 batches) commits; the process stops after the first batch of shard 1.
    proc = pipeline_proc(args, pause_after=3)
    line = ""
    deadline = time.time() + 240
    while "PAUSED" not in line and time.time() < deadline:
        line = proc.stderr.readline()
        assert line or proc.poll() is None, "extract exited before pausing"
    assert "shard=1" in line
    # let the first batch of shard 1 reach disk, then kill without warning
    shard_dir = path / "shards/00001/hidden/c"
    while not any(p.is_file() for p in shard_dir.rglob("*")) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    store = HiddenStore(str(path))
    assert list(store.committed()) == [0] and store.has_data(1)  # half of shard 1 on disk, not committed
    assert (path / "_locks/00001.lock").exists()  # the dead process's lock is still there

    p = run_pipeline(args)
    assert p.returncode == 0, p.stderr
    assert_stores_equal(path, reference)


def test_ctrl_c_mid_shard_leaves_the_store_consistent(tmp_path, small_dataset, reference):
    path = tmp_path / "hs.zarr"
    args = cli_args(path, small_dataset, "0-3")
    proc = pipeline_proc(args, pause_after=3)
    deadline = time.time() + 240
    while "PAUSED" not in proc.stderr.readline():
        assert proc.poll() is None and time.time() < deadline
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert err.strip().splitlines()[-1].startswith("error: interrupted: committed shards are kept")
    assert list(HiddenStore(str(path)).committed()) == [0]
    assert not list((path / "_locks").glob("*.lock"))  # released on the way out
    p = run_pipeline(args)
    assert p.returncode == 0, p.stderr
    assert_stores_equal(path, reference)


def test_two_processes_on_disjoint_ranges_equal_one(tmp_path, small_dataset, reference):
    path = tmp_path / "hs.zarr"
    a = pipeline_proc(cli_args(path, small_dataset, "0,2"))
    b = pipeline_proc(cli_args(path, small_dataset, "1,3"))
    for p in (a, b):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    assert_stores_equal(path, reference)


def test_an_overlapping_range_leaves_the_shard_a_live_writer_holds(tmp_path, small_dataset, reference):
    path = tmp_path / "hs.zarr"
    holder = pipeline_proc(cli_args(path, small_dataset, "0-1"), pause_after=1)  # pauses inside shard 0
    try:
        deadline = time.time() + 240
        while "PAUSED" not in holder.stderr.readline():
            assert holder.poll() is None and time.time() < deadline
        p = run_pipeline(cli_args(path, small_dataset, "0-3"))
        assert p.returncode == 0, p.stderr
        assert "left 1 to other live processes (0: " in p.stdout
        assert list(HiddenStore(str(path)).committed()) == [1, 2, 3]  # shard 0 is the holder's
    finally:
        holder.kill()
        holder.wait()
    p = run_pipeline(cli_args(path, small_dataset, "0-3"))
    assert p.returncode == 0, p.stderr
    assert_stores_equal(path, reference)


def test_two_ranks_under_torchrun_equal_one_process(tmp_path, small_dataset, reference):
    path = tmp_path / "hs.zarr"
    p = pipeline_proc(cli_args(path, small_dataset, "0-3"), nproc=2)
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err
    assert "rank 0/2 store" in err and "rank 1/2 store" in err  # each read its place from torchrun
    assert "rank 0/2 wrote" in out and "rank 1/2 wrote" in out
    assert_stores_equal(path, reference)


def test_ranks_killed_mid_shard_then_another_world_size_equals_uninterrupted(tmp_path, small_dataset, reference):
    path = tmp_path / "hs.zarr"
    proc = pipeline_proc(cli_args(path, small_dataset, "0-3"), nproc=2, pause_after=1)  # each rank: one batch
    try:
        paused, deadline = 0, time.time() + 600
        while paused < 2 and time.time() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "torchrun exited before both ranks paused"
            paused += "PAUSED" in line
        assert paused == 2
    finally:  # the agent and both ranks, without warning (torchrun starts ranks in sessions of their own)
        for child in psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]:
            child.kill()
        proc.wait()
    assert not HiddenStore(str(path)).committed() and list((path / "_locks").glob("*.lock"))
    p = pipeline_proc(cli_args(path, small_dataset, "0-3"), nproc=3)
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err
    assert_stores_equal(path, reference)
