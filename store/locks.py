"""Exclusive lock files (O_CREAT|O_EXCL) for shards and the root, with stale-lock recovery.

A lock records host and pid. A lock left by a killed process on this host (its pid is gone) is
stale and is taken over; a lock held by a live process, or by another host, is respected.
Works on local and shared POSIX file systems; object stores get no locks (see docs/usage.md).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

HOST = socket.gethostname()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LockFile:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.held = False

    def owner(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {"host": "?", "pid": -1}  # being written right now, or garbage: treat as held

    def stale(self, owner: dict) -> bool:
        return owner.get("host") == HOST and owner.get("pid", -1) > 0 and not _alive(owner["pid"])

    def try_acquire(self) -> dict | None:
        """Take the lock; on failure return the holder's record. Takes over stale locks."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self.owner()
                if owner is None:
                    continue  # released in between
                if self.stale(owner):
                    self._remove_stale(owner)
                    continue
                return owner
            with os.fdopen(fd, "w") as fh:
                json.dump({"host": HOST, "pid": os.getpid(), "since": time.time()}, fh)
            self.held = True
            return None
        return self.owner() or {"host": "?", "pid": -1}

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
        return self.held and owner is not None and owner.get("host") == HOST and owner.get("pid") == os.getpid()

    def acquire(self, timeout: float, poll: float = 0.2) -> None:
        deadline = time.monotonic() + timeout
        while (owner := self.try_acquire()) is not None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.path} held by {owner.get('host')}:{owner.get('pid')}")
            time.sleep(poll)

    def release(self) -> None:
        if self.held:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            self.held = False
