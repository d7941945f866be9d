"""Lock files: exclusive, leases kept alive by a heartbeat, stale locks taken over, live ones kept."""

import json
import os
import subprocess
import sys
import time

import pytest

from store.io.locks import HOST, IDENTITY, LockFile


def dead_pid() -> int:
    return int(
        subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    )


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


@pytest.mark.parametrize(
    "record",
    [
        {"host": HOST, "pid": "DEAD", "identity": IDENTITY},
        {"host": HOST, "pid": "DEAD"},  # written before leases: no identity
    ],
)
def test_the_lock_of_a_dead_process_here_is_taken_over(tmp_path, record):
    path = planted(tmp_path / "x.lock", {**record, "pid": dead_pid()})
    lock = LockFile(path)
    assert lock.try_acquire() is None and lock.still_held()
    lock.release()


@pytest.mark.parametrize(
    "record",
    [
        {"host": "elsewhere", "pid": 1, "identity": "elsewhere/boot/pid:[1]"},  # another machine
        {"host": HOST, "pid": "DEAD", "identity": f"{HOST}/other-boot/pid:[1]"},  # same host name, other pid table
    ],
)
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


# -- leases on an object store (store/io/object_lease.py), over an in-memory store with S3's conditions --
class Objects:
    """S3's conditional writes (store/io/s3_objects.S3Objects), in memory, each one atomic, on a clock
    the test moves (`now`): an object's age is `now` minus when it was last written."""

    def __init__(self) -> None:
        self.now, self.objects, self.writes = 1000.0, {}, 0
        self.before_replace = None  # called once before the next replace: another writer gets in first

    def _put(self, path, data):
        self.writes += 1
        etag = f'"{self.writes}"'
        self.objects[path] = (data, etag, self.now)
        return etag

    def create(self, path, data):
        return None if path in self.objects else self._put(path, data)

    def replace(self, path, data, etag):
        if self.before_replace is not None:
            hook, self.before_replace = self.before_replace, None
            hook()
        return self._put(path, data) if path in self.objects and self.objects[path][1] == etag else None

    def read(self, path):
        from store.io.s3_objects import Seen

        if path not in self.objects:
            return None
        data, etag, t = self.objects[path]
        return Seen(data, etag, self.now - t)

    def delete(self, path, etag):
        if path in self.objects and self.objects[path][1] == etag:
            del self.objects[path]
            return True
        return False

    def refresh(self):
        pass

    def record(self, path) -> dict:
        return json.loads(self.objects[path][0])

    def plant(self, path, record: dict) -> None:
        """A lease as another process left it, written now."""
        self._put(path, json.dumps(record).encode())


def lease(objects, lease_s=600.0, heartbeat_s=3600.0):
    """An object lease whose heartbeat does not beat during the test (unless asked)."""
    from store.io.object_lease import ObjectLease

    return ObjectLease(objects, "b/s.zarr/_locks/x.lock", lease_s, heartbeat_s)


ELSEWHERE = {"host": "elsewhere", "pid": 1, "identity": "elsewhere/boot/pid:[1]"}


def test_an_object_lease_is_exclusive_and_its_release_frees_it():
    objects = Objects()
    a, b = lease(objects), lease(objects)
    assert a.try_acquire() is None and a.still_held()
    owner = b.try_acquire()
    assert owner == objects.record(a.path) and owner["pid"] == os.getpid() and owner["identity"] == IDENTITY
    a.release()
    assert objects.objects == {}
    assert b.try_acquire() is None and b.still_held()
    b.release()


def test_an_object_lease_of_a_live_holder_elsewhere_is_respected_until_it_runs_out():
    objects = Objects()
    objects.plant("b/s.zarr/_locks/x.lock", ELSEWHERE)
    objects.now += 599
    assert lease(objects).try_acquire() == ELSEWHERE
    objects.now += 2
    taker = lease(objects)
    assert taker.try_acquire() is None and taker.still_held()
    assert objects.record(taker.path)["identity"] == IDENTITY


def test_the_longer_of_the_takers_and_the_holders_lease_applies():
    objects = Objects()
    objects.plant("b/s.zarr/_locks/x.lock", {**ELSEWHERE, "lease_s": 1200})
    objects.now += 700
    assert lease(objects, lease_s=10).try_acquire()["host"] == "elsewhere"  # the holder promised 1200 s
    objects.now += 501
    assert lease(objects, lease_s=10).try_acquire() is None


def test_the_object_lease_of_a_dead_process_here_is_taken_over_at_once():
    objects = Objects()
    objects.plant("b/s.zarr/_locks/x.lock", {"host": HOST, "pid": dead_pid(), "identity": IDENTITY})
    assert lease(objects).try_acquire() is None


def test_a_replaced_holder_cannot_commit_nor_delete_its_replacements_lease():
    objects = Objects()
    stalled, taker = lease(objects, lease_s=60), lease(objects, lease_s=60)
    assert stalled.try_acquire() is None
    objects.now += 61  # no heartbeat for a whole lease (a stopped node)
    assert taker.try_acquire() is None
    assert not stalled.still_held()  # the fence a commit passes first
    assert objects.record(taker.path)["token"] == taker._record["token"]  # its failed renewal wrote nothing
    stalled.release()
    assert taker.still_held()


def test_of_two_takers_that_saw_the_same_stale_lease_one_wins():
    objects = Objects()
    objects.plant("b/s.zarr/_locks/x.lock", ELSEWHERE)
    objects.now += 700
    first, second = lease(objects), lease(objects)
    objects.before_replace = lambda: first.try_acquire()  # first takes it over between second's read and write
    owner = second.try_acquire()
    assert owner is not None and owner["token"] == first._record["token"]
    assert first.still_held() and not second.held


def test_a_holder_that_renews_while_it_is_being_taken_over_keeps_its_lease():
    objects = Objects()
    holder, taker = lease(objects, lease_s=60), lease(objects, lease_s=60)
    assert holder.try_acquire() is None
    objects.now += 61
    objects.before_replace = lambda: holder.still_held()  # a late heartbeat, between taker's read and write
    assert taker.try_acquire()["token"] == holder._record["token"]
    assert holder.still_held()


def test_the_object_lease_heartbeat_keeps_it():
    objects = Objects()
    holder = lease(objects, lease_s=60, heartbeat_s=0.05)
    assert holder.try_acquire() is None
    objects.now += 61
    time.sleep(0.5)  # beats rewrite it at the new time
    assert lease(objects, lease_s=60).try_acquire() is not None
    holder.release()
    assert objects.objects == {}


def test_an_unreadable_object_lease_is_held_until_it_runs_out():
    objects = Objects()
    objects._put("b/s.zarr/_locks/x.lock", b"{not json")
    assert lease(objects).try_acquire() == {"host": "?", "pid": -1}
    objects.now += 601
    assert lease(objects).try_acquire() is None
