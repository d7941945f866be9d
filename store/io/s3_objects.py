"""Conditional writes on S3 (through s3fs): what object-store leases (store/io/object_lease.py) are
built from, and nothing else.

  create(path, data)        a PUT with If-None-Match: * (only one of any number of creators wins)
  replace(path, data, etag) a PUT with If-Match: etag (fails once anyone else has written the object)
  read(path)                one GET: the bytes, the ETag they carry, and the object's age by the
                            server's own clock (its Date header minus the object's Last-Modified),
                            so no node's clock is trusted
  delete(path, etag)        a DELETE with If-Match: etag

AWS S3 honours all four (conditional PUTs since 2024, conditional DELETEs since 2025), as do
moto's server and the S3-compatible stores that implement them; other object stores get no
leases (`conditional_objects` returns None).

Some S3-compatible stores (older MinIO, Ceph RGW, appliance gateways) accept the conditional headers
and ignore them: every create and every replace then succeeds, every lease "wins", and processes
overwrite each other's shards. `check_honoured` finds such a store with a probe before anything
relies on it (a few requests, once per process and store) and refuses it in one line.
"""

from __future__ import annotations

import os
import time
import uuid
from email.utils import parsedate_to_datetime
from typing import NamedTuple

import fsspec.asyn

from store.errors import StoreError
from store.io.locks import HOST
from store.io.object_store import endpoint, failures

LOST = ("PreconditionFailed", "ConditionalRequestConflict")  # S3's 412 and 409: another writer got there first
_HONOURED: set[tuple[str, str]] = set()  # (endpoint, folder) whose probe passed in this process


class Seen(NamedTuple):
    data: bytes
    etag: str
    age_s: float  # seconds since the object was last written, by the server's clock


def conditional_objects(fs) -> S3Objects | None:
    """Conditional writes on fs, where its kind of object store has them (S3), else None."""
    return S3Objects(fs) if "s3" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)) else None


class S3Objects:
    def __init__(self, fs) -> None:
        self.fs = fs

    def create(self, path: str, data: bytes) -> str | None:
        """Write a new object; its ETag, or None when one is there already."""
        try:
            return self.fs.pipe_file(path, data, mode="create")["ETag"]
        except FileExistsError:
            return None
        except OSError as e:
            if _lost(e):
                return None
            raise

    def replace(self, path: str, data: bytes, etag: str) -> str | None:
        """Overwrite the object if it is still the one of `etag`; its new ETag, or None when it is not
        (or is gone)."""
        try:
            return self.fs.pipe_file(path, data, IfMatch=etag)["ETag"]
        except FileNotFoundError:
            return None
        except OSError as e:
            if _lost(e):
                return None
            raise

    def read(self, path: str) -> Seen | None:
        """The object's bytes, ETag and age; None when there is none."""
        try:
            return fsspec.asyn.sync(self.fs.loop, self._read, path)
        except FileNotFoundError:
            return None

    async def _read(self, path: str) -> Seen:
        bucket, key, _ = self.fs.split_path(path)
        r = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
        data = await r["Body"].read()
        date = r["ResponseMetadata"].get("HTTPHeaders", {}).get("date")
        now = parsedate_to_datetime(date).timestamp() if date else time.time()
        return Seen(data, r["ETag"], now - r["LastModified"].timestamp())

    def delete(self, path: str, etag: str) -> bool:
        """Delete the object if it is still the one of `etag`; whether it was."""
        bucket, key, _ = self.fs.split_path(path)
        try:
            self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=etag)
        except FileNotFoundError:
            return False
        except OSError as e:
            if _lost(e):
                return False
            raise
        finally:
            self.fs.invalidate_cache(path)
        return True

    def refresh(self) -> None:
        """Forget the file system's cached listings: what other processes wrote is seen from now on."""
        self.fs.invalidate_cache()

    # -- the probe -------------------------------------------------------------------------
    def check_honoured(self, location: str, folder: str) -> None:
        """The object store honours If-None-Match: * and If-Match, or one line (StoreError) naming the
        store (`location`) and what it ignored. Probed once per process for each folder (a store's
        `_locks/`) with an object of its own there: created twice with If-None-Match: * (the second must
        fail), replaced with If-Match on its ETag (must succeed), then with If-Match on that now stale
        ETag (must fail), then deleted: five requests; none again in this process once it passed."""
        key = (endpoint(self.fs), folder.rstrip("/"))
        if key in _HONOURED:
            return
        path = f"{key[1]}/probe-{HOST}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        with failures(location, self.fs):  # an endpoint that does not answer, no credentials: their own line
            try:
                ignored = self._probe(location, path)
            finally:
                self._remove(path)
        if ignored:
            raise StoreError(
                f"{location}: the object store at {endpoint(self.fs)} ignores S3's conditional writes "
                f"({' and '.join(ignored)}), on which extraction's leases rely: processes would each win "
                "the same shard and overwrite each other's writes, so nothing was written; use an object "
                "store that honours If-None-Match and If-Match on PUT (AWS S3 does), or extract into a "
                "POSIX file system (a local or shared disk: lock files)"
            )
        _HONOURED.add(key)

    def _probe(self, location: str, path: str) -> list[str]:
        """The conditions the store ignored (none: it honours both), by writing `path`. A store that
        refuses a write the conditions allow (or answers one with an error): one line."""
        first = self._step(location, "a create with If-None-Match: *", lambda: self.create(path, b"probe 1"))
        if first is None:
            raise self._refused(location, f"refused to create a new object, {path}, with If-None-Match: *")
        ignored = []
        if self._step(location, "a second create with If-None-Match: *", lambda: self.create(path, b"probe 2")):
            ignored.append("If-None-Match: *: a second create of one object succeeded")
        else:
            again = self._step(location, "a replace with If-Match", lambda: self.replace(path, b"probe 3", first))
            if again is None:
                raise self._refused(location, f"refused to replace {path} with If-Match on its own ETag")
        if self._step(location, "a replace with If-Match", lambda: self.replace(path, b"probe 4", first)):
            ignored.append("If-Match: a replace with a stale ETag succeeded")
        return ignored

    def _step(self, location: str, what: str, request):
        """One request of the probe; an answer other than success or a failed condition: one line
        (raised from it, so that `failures` still tells an endpoint that does not answer)."""
        try:
            return request()
        except OSError as e:
            text = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise self._refused(location, f"answered {what} with: {text}") from e

    def _refused(self, location: str, what: str) -> StoreError:
        return StoreError(
            f"{location}: the object store at {endpoint(self.fs)} {what}; extraction's leases need S3's "
            "conditional writes (If-None-Match, If-Match on PUT) and leave to write under the store"
        )

    def _remove(self, path: str) -> None:
        """Delete the probe's object (unconditionally: no other process knows its name); one that cannot
        be deleted is left (it is no lease, and nothing reads it)."""
        try:
            self.fs.rm_file(path)
        except Exception:  # noqa: BLE001 - the probe's answer matters, not its litter
            pass


def _lost(e: BaseException) -> bool:
    """Whether e is S3's answer that a condition did not hold (412) or lost to a concurrent
    conditional write (409)."""
    response = getattr(e.__cause__, "response", None) or {}
    return response.get("Error", {}).get("Code") in LOST
