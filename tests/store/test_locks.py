import json
import os
import subprocess
import sys

from store.locks import HOST, LockFile


def test_lock_is_exclusive(tmp_path):
    a, b = LockFile(tmp_path / "x.lock"), LockFile(tmp_path / "x.lock")
    assert a.try_acquire() is None and a.still_held()
    owner = b.try_acquire()
    assert owner == {**owner, "host": HOST, "pid": os.getpid()}
    a.release()
    assert b.try_acquire() is None
    b.release()
    assert not (tmp_path / "x.lock").exists()


def test_stale_lock_of_dead_process_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path = tmp_path / "x.lock"
    path.write_text(json.dumps({"host": HOST, "pid": int(dead.stdout)}))
    lock = LockFile(path)
    assert lock.try_acquire() is None
    assert lock.still_held()


def test_lock_of_other_host_is_respected(tmp_path):
    path = tmp_path / "x.lock"
    path.write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    assert LockFile(path).try_acquire() == {"host": "elsewhere", "pid": 1}
