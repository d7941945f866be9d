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
"""

from __future__ import annotations

import time
from email.utils import parsedate_to_datetime
from typing import NamedTuple

import fsspec.asyn

LOST = ("PreconditionFailed", "ConditionalRequestConflict")  # S3's 412 and 409: another writer got there first


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


def _lost(e: BaseException) -> bool:
    """Whether e is S3's answer that a condition did not hold (412) or lost to a concurrent
    conditional write (409)."""
    response = getattr(e.__cause__, "response", None) or {}
    return response.get("Error", {}).get("Code") in LOST
