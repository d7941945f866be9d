"""Leases on an object store (S3): the guarantees of the lock files of store/io/locks.py, from
conditional writes alone (store/io/s3_objects.py).

A lease is one object, `_locks/NAME.lock`, holding its holder's record: host name, pid and identity
(as a lock file's), a token unique to this acquisition, the lease length and a beat count.
  - Acquired by creating it (If-None-Match: *): of any number of processes arriving together,
    exactly one creates it; the others read the holder's record.
  - Kept by rewriting it every heartbeat (If-Match: its ETag). A rewrite fails once anyone else
    has replaced the object, and the holder then knows it lost the lease.
  - Stale, and taken over, when its holder is a process of this process table that is gone, or
    when it was not rewritten for its lease: the longer of the taker's lease and the one the record
    states, measured by the server's clock (its Date minus the object's Last-Modified; no node's
    clock is trusted, unlike lock files' mtimes).
  - Taken over by a rewrite conditional on the stale ETag seen: of several takers one wins, and a
    holder that renewed in between keeps its lease.
  - Fenced at commit: `still_held` renews it conditionally, so a holder that was replaced learns
    it there and does not commit, and one that was not has a whole lease ahead for the commit's
    PUT that follows (milliseconds). Only a holder stalled for a whole lease between those two
    calls could still commit after being replaced (docs/reliability.md).
  - Released by a delete conditional on its ETag, so a replaced holder never deletes its
    replacement's lease.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid

from store.io.locks import HEARTBEAT_S, HOST, IDENTITY, LEASE_S, holder_gone, wait_for
from store.io.s3_objects import S3Objects

UNREADABLE = {"host": "?", "pid": -1}  # a record that does not parse: held, until its lease runs out


class ObjectLease:
    def __init__(
        self, objects: S3Objects, path: str, lease_s: float = LEASE_S, heartbeat_s: float = HEARTBEAT_S
    ) -> None:
        self.objects, self.path = objects, path
        self.lease_s, self.heartbeat_s = lease_s, heartbeat_s
        self.held = False
        self._etag: str | None = None
        self._record: dict = {}
        self._guard = threading.Lock()  # the heartbeat and a commit's check renew one at a time
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def stale(self, owner: dict, age_s: float) -> bool:
        """Whether a lease with this record, last written age_s ago, may be taken over."""
        recorded = owner.get("lease_s")
        lease = max(self.lease_s, recorded) if isinstance(recorded, (int, float)) else self.lease_s
        return holder_gone(owner) or age_s > lease

    def try_acquire(self) -> dict | None:
        """Take the lease; on failure return the holder's record. Takes over stale leases."""
        owner = UNREADABLE
        for _ in range(3):
            record = self._new_record()
            if (etag := self.objects.create(self.path, _encode(record))) is not None:
                return self._won(record, etag)
            seen = self.objects.read(self.path)
            if seen is None:
                continue  # released in between
            owner = _decode(seen.data)
            if not self.stale(owner, seen.age_s):
                return owner
            if (etag := self.objects.replace(self.path, _encode(record), seen.etag)) is not None:
                return self._won(record, etag)
        return owner  # it kept changing hands: held, for now

    def acquire(self, timeout: float, poll: float = 0.5) -> None:
        wait_for(self, timeout, poll)

    def still_held(self) -> bool:
        """Renew the lease, if it is still ours: True when it was (a whole lease is then ahead)."""
        return self.held and self._renew()

    def release(self) -> None:
        if self._beat is not None:
            self._stop.set()
            self._beat.join()
            self._beat = None
        with self._guard:
            if self.held:
                self.objects.delete(self.path, self._etag)
            self.held = False

    # -- inside ----------------------------------------------------------------------------
    def _new_record(self) -> dict:
        return {
            "host": HOST,
            "pid": os.getpid(),
            "identity": IDENTITY,
            "since": time.time(),
            "token": uuid.uuid4().hex,
            "lease_s": self.lease_s,
            "beat": 0,
        }

    def _won(self, record: dict, etag: str) -> None:
        self._record, self._etag, self.held = record, etag, True
        self.objects.refresh()  # what others committed before is seen now
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name=f"lease {self.path.rsplit('/', 1)[-1]}", daemon=True)
        self._beat.start()
        return None

    def _renew(self) -> bool:
        """Rewrite the lease if it is still ours; whether it was. A transient failure raises."""
        with self._guard:
            if not self.held:
                return False
            record = {**self._record, "beat": self._record["beat"] + 1}
            etag = self.objects.replace(self.path, _encode(record), self._etag)
            if etag is None:
                self.held = False  # replaced: it is someone else's now
                return False
            self._record, self._etag = record, etag
            return True

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                if not self._renew():
                    return  # taken from us: still_held() says so before a commit
            except Exception:  # noqa: BLE001 - the store did not answer this time: the next beat tries again
                continue


def _encode(record: dict) -> bytes:
    return json.dumps(record, sort_keys=True).encode()


def _decode(data: bytes) -> dict:
    try:
        owner = json.loads(data)
    except ValueError:
        return UNREADABLE
    return owner if isinstance(owner, dict) else UNREADABLE
