"""Exclusive lock files (O_CREAT|O_EXCL) for shards and the root: leases, with stale-lock recovery.

A lock records its holder: host name, pid, and an identity unique to the pid namespace the pid
lives in (host name, kernel boot id, pid namespace), so that containers sharing a host name, or a
machine rebooted since, are never mistaken for the same process table. While it is held, a thread
refreshes the file's modification time every `heartbeat_s` (the lease). A lock is stale, and taken
over, when
  - its holder has this process's identity and its pid is gone (a killed process here), or
  - its lease ran out: no heartbeat for `lease_s` (a dead node, a killed container).
Any other lock is respected. Works on local and shared POSIX file systems (lease times compare
the file server's mtimes with this machine's clock: keep clocks within a minute, as NTP does);
S3 gets the same leases from conditional writes (store/io/object_lease.py), other object stores none.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

HOST = socket.gethostname()
LEASE_S = 600.0  # a lock without a heartbeat for this long belongs to a dead process
HEARTBEAT_S = 30.0


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "?"


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "?"


IDENTITY = f"{HOST}/{_read('/proc/sys/kernel/random/boot_id')}/{_pid_namespace()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _checkable_here(owner: dict) -> bool:
    """Whether the holder's pid lives in this process table (records written before leases carry
    no identity, only the host name)."""
    return owner["identity"] == IDENTITY if "identity" in owner else owner.get("host") == HOST


def holder_gone(owner: dict) -> bool:
    """Whether the lock's holder is a process of this process table that no longer runs."""
    pid = owner.get("pid", -1)
    return _checkable_here(owner) and isinstance(pid, int) and pid > 0 and not _alive(pid)


def heartbeat_for(lease_s: float) -> float:
    """How often a lease of lease_s is renewed: every HEARTBEAT_S, or four times a lease when shorter."""
    return min(HEARTBEAT_S, lease_s / 4)


def wait_for(lock, timeout: float, poll: float) -> None:
    """Try `lock` (a LockFile or an object lease: try_acquire() -> the holder, or None once it is
    ours) every `poll` seconds; TimeoutError naming the holder after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (owner := lock.try_acquire()) is not None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{lock.path} held by {owner.get('host')}:{owner.get('pid')}")
        time.sleep(poll)


class LockFile:
    def __init__(self, path: Path, lease_s: float = LEASE_S, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.path = Path(path)
        self.lease_s, self.heartbeat_s = lease_s, heartbeat_s
        self.held = False
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def owner(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {"host": "?", "pid": -1}  # being written right now, or garbage: treat as held

    def stale(self, owner: dict) -> bool:
        if holder_gone(owner):
            return True
        try:
            return time.time() - self.path.stat().st_mtime > self.lease_s
        except FileNotFoundError:
            return False

    def try_acquire(self) -> dict | None:
        """Take the lock; on failure return the holder's record. Takes over stale locks."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)  # the umask applies
            except FileExistsError:
                owner = self.owner()
                if owner is None:
                    continue  # released in between
                if self.stale(owner):
                    self._remove_stale(owner)
                    continue
                return owner
            with os.fdopen(fd, "w") as fh:
                json.dump({"host": HOST, "pid": os.getpid(), "identity": IDENTITY, "since": time.time()}, fh)
            self.held = True
            self._start_heartbeat()
            return None
        return self.owner() or {"host": "?", "pid": -1}

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name=f"lease {self.path.name}", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self.path)
            except FileNotFoundError:
                return  # taken from us: still_held() says so before a commit

    def _remove_stale(self, owner: dict) -> None:
        # Move it aside, then look at what was moved: if another process reclaimed the lock in
        # between, the file moved is its live lock, and it goes back.
        grave = self.path.with_name(f"{self.path.name}.stale.{os.getpid()}")
        try:
            os.rename(self.path, grave)
        except FileNotFoundError:
            return
        try:
            moved = json.loads(grave.read_text())
        except (OSError, ValueError):
            moved = owner
        if moved != owner:
            try:
                os.link(grave, self.path)
            except FileExistsError:
                pass
        grave.unlink(missing_ok=True)

    def still_held(self) -> bool:
        """True while the file on disk is still this process's lock (checked before committing)."""
        owner = self.owner()
        return self.held and owner is not None and owner.get("identity") == IDENTITY and owner.get("pid") == os.getpid()

    def acquire(self, timeout: float, poll: float = 0.2) -> None:
        wait_for(self, timeout, poll)

    def release(self) -> None:
        if self.held:
            self._stop.set()
            if self._beat is not None:
                self._beat.join()
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            self.held = False
