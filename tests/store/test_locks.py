"""Lock files: exclusive, leases kept alive by a heartbeat, stale locks taken over, live ones kept."""

import json
import os
import subprocess
import sys
import time

import pytest

from store.locks import HOST, IDENTITY, LockFile


def dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def planted(path, record: dict, age_s: float = 0.0):
    """A lock file as another process left it, last refreshed age_s ago."""
    path.write_text(json.dumps(record))
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def test_lock_is_exclusive(tmp_path):
    a, b = LockFile(tmp_path / "x.lock"), LockFile(tmp_path / "x.lock")
    assert a.try_acquire() is None and a.still_held()
    owner = b.try_acquire()
    assert owner == {**owner, "host": HOST, "pid": os.getpid(), "identity": IDENTITY}
    a.release()
    assert b.try_acquire() is None
    b.release()
    assert not (tmp_path / "x.lock").exists()


@pytest.mark.parametrize("record", [
    {"host": HOST, "pid": "DEAD", "identity": IDENTITY},
    {"host": HOST, "pid": "DEAD"},  # written before leases: no identity
])
def test_the_lock_of_a_dead_process_here_is_taken_over(tmp_path, record):
    path = planted(tmp_path / "x.lock", {**record, "pid": dead_pid()})
    lock = LockFile(path)
    assert lock.try_acquire() is None and lock.still_held()
    lock.release()


@pytest.mark.parametrize("record", [
    {"host": "elsewhere", "pid": 1, "identity": "elsewhere/boot/pid:[1]"},  # another machine
    {"host": HOST, "pid": "DEAD", "identity": f"{HOST}/other-boot/pid:[1]"},  # same host name, other pid table
])
def test_a_lock_with_a_live_lease_elsewhere_is_respected(tmp_path, record):
    record = {**record, "pid": dead_pid()} if record["pid"] == "DEAD" else record
    path = planted(tmp_path / "x.lock", record, age_s=60)
    assert LockFile(path, lease_s=600).try_acquire() == record


def test_a_lock_whose_lease_ran_out_is_taken_over(tmp_path):
    record = {"host": "elsewhere", "pid": 1, "identity": "elsewhere/boot/pid:[1]"}
    path = planted(tmp_path / "x.lock", record, age_s=700)
    lock = LockFile(path, lease_s=600)
    assert lock.try_acquire() is None and lock.still_held()
    lock.release()


def test_the_heartbeat_keeps_the_lease(tmp_path):
    holder = LockFile(tmp_path / "x.lock", lease_s=1.0, heartbeat_s=0.1)
    assert holder.try_acquire() is None
    time.sleep(1.5)  # longer than the lease: only the heartbeat keeps it fresh
    other = LockFile(tmp_path / "x.lock", lease_s=1.0)
    assert other.try_acquire() is not None
    holder.release()
    assert other.try_acquire() is None
    other.release()


@pytest.mark.parametrize("mask, mode", [(0o002, "0664"), (0o022, "0644"), (0o077, "0600")])
def test_a_lock_file_has_the_mode_the_umask_gives_any_file(tmp_path, mask, mode):
    """Another account that shares the directory reads who holds it, as it reads any file there."""
    from tests.modes import file_modes, umask

    with umask(mask):
        lock = LockFile(tmp_path / "x.lock")
        assert lock.try_acquire() is None
    assert file_modes(tmp_path) == {"x.lock": mode}
    lock.release()
