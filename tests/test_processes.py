"""Real processes: SIGKILL mid-shard then resume, two writers at once, overlapping ranges."""

import signal
import time

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


def test_overlapping_range_is_refused_while_a_writer_runs(tmp_path, small_dataset):
    path = tmp_path / "hs.zarr"
    holder = pipeline_proc(cli_args(path, small_dataset, "0-1"), pause_after=1)
    try:
        deadline = time.time() + 240
        while "PAUSED" not in holder.stderr.readline():
            assert holder.poll() is None and time.time() < deadline
        p = run_pipeline(cli_args(path, small_dataset, "1-2"))
        assert p.returncode == 2
        err = p.stderr.strip().splitlines()[-1]
        assert err.startswith("error: ") and "shards 1 are being written by" in err and "overlapping" in err
        assert not (path / "_commits/00002.json").exists()  # refused before writing anything
    finally:
        holder.kill()
        holder.wait()
