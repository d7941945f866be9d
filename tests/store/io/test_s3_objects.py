"""The probe of an object store's conditional writes (store/io/s3_objects.S3Objects.check_honoured),
run on an in-memory S3 with the surface of s3fs that S3Objects uses: one that honours If-None-Match
and If-Match passes in five requests, once per process and store; one that drops either condition,
as some S3-compatible stores do, is refused in one line naming the store and what it ignored, and
extraction's writer (store/store_writer.py) takes no lease on it. Through a real S3 API behind a
proxy that strips the headers: tests/test_s3_extract.py (`-m s3`)."""

from __future__ import annotations

import hashlib
import uuid

import pytest

from store.errors import StoreError
from store.io import s3_objects
from store.io.object_lease import ObjectLease
from store.io.s3_objects import S3Objects

ENDPOINT = "http://gateway.example:9000"
NONE_MATCH, MATCH = "If-None-Match", "If-Match"


class _ClientError(Exception):
    """What botocore raises, as far as S3Objects reads it: the response's error code."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.response = {"Error": {"Code": code}}


def _failed(code: str, message: str, kind=OSError) -> OSError:
    """An error as s3fs raises it (translate_boto_error): an OSError from the client's error."""
    e = kind(message)
    e.__cause__ = _ClientError(code)
    return e


class MemoryS3:
    """S3 in memory, as S3Objects reaches it through s3fs: PUTs (pipe_file) that honour If-None-Match: *
    and If-Match, except those named in `ignore` (accepted and dropped, as some S3-compatible stores
    do); `answer`: an error every conditional PUT gets instead (a store that does not implement them).
    Every request is recorded."""

    protocol = ("s3", "s3a")
    endpoint_url = ENDPOINT

    def __init__(self, ignore: tuple[str, ...] = (), answer: OSError | None = None) -> None:
        self.ignore, self.answer = set(ignore), answer
        self.objects: dict[str, tuple[bytes, str]] = {}
        self.requests: list[tuple[str, str, str]] = []  # (method, path, condition)

    def pipe_file(self, path: str, data: bytes, mode: str = "overwrite", IfMatch: str | None = None) -> dict:
        condition = NONE_MATCH if mode == "create" else MATCH if IfMatch is not None else ""
        self.requests.append(("PUT", path, condition))
        if condition and self.answer is not None:
            raise self.answer
        if condition == NONE_MATCH and NONE_MATCH not in self.ignore and path in self.objects:
            raise _failed("PreconditionFailed", "At least one of the pre-conditions you specified did not hold")
        if condition == MATCH and MATCH not in self.ignore:
            if path not in self.objects:
                raise _failed("NoSuchKey", path, FileNotFoundError)
            if self.objects[path][1] != IfMatch:
                raise _failed("PreconditionFailed", "At least one of the pre-conditions you specified did not hold")
        etag = f'"{hashlib.md5(data).hexdigest()}"'
        self.objects[path] = (data, etag)
        return {"ETag": etag}

    def rm_file(self, path: str) -> None:
        self.requests.append(("DELETE", path, ""))
        self.objects.pop(path, None)

    def split_path(self, path: str):
        bucket, key = path.split("/", 1)
        return bucket, key, None

    def invalidate_cache(self, path: str | None = None) -> None:
        pass


@pytest.fixture(autouse=True)
def unprobed(monkeypatch):
    """Each test a process that has probed no store yet."""
    monkeypatch.setattr(s3_objects, "_HONOURED", set())


def folder() -> str:
    return f"bucket/{uuid.uuid4().hex[:8]}.zarr/_locks"


def test_a_store_that_honours_both_conditions_passes_in_five_requests_once_per_process_and_store():
    fs = MemoryS3()
    objects, locks = S3Objects(fs), folder()
    objects.check_honoured("s3://x", locks)
    assert [(m, c) for m, _, c in fs.requests] == [
        ("PUT", NONE_MATCH),
        ("PUT", NONE_MATCH),  # refused: the object exists
        ("PUT", MATCH),  # on its own ETag: done
        ("PUT", MATCH),  # on that ETag, stale now: refused
        ("DELETE", ""),
    ]
    probe = fs.requests[0][1]
    assert probe.startswith(locks + "/probe-") and fs.objects == {}  # the probe's object, removed
    objects.check_honoured("s3://x", locks)
    S3Objects(fs).check_honoured("s3://x", locks)  # another handle of this process on the same store
    assert len(fs.requests) == 5
    objects.check_honoured("s3://y", folder())  # another store: probed
    assert len(fs.requests) == 10 and fs.requests[5][1] != probe


@pytest.mark.parametrize(
    "ignore, named, unnamed",
    [
        ((NONE_MATCH,), "If-None-Match: *: a second create of one object succeeded", "If-Match:"),
        ((MATCH,), "If-Match: a replace with a stale ETag succeeded", "If-None-Match"),
        ((NONE_MATCH, MATCH), "If-None-Match: *: a second create of one object succeeded and If-Match: a replace", ""),
    ],
)
def test_a_store_that_drops_a_condition_is_refused_in_one_line_naming_it(ignore, named, unnamed):
    fs = MemoryS3(ignore)
    objects, locks = S3Objects(fs), folder()
    with pytest.raises(StoreError) as e:
        objects.check_honoured("s3://bucket/hs.zarr", locks)
    line = str(e.value)
    assert line.startswith(f"s3://bucket/hs.zarr: the object store at {ENDPOINT} ignores S3's conditional writes (")
    what = line.split("conditional writes (", 1)[1].split("), on which", 1)[0]  # what it ignored
    assert named in what and (not unnamed or unnamed not in what) and "\n" not in line
    assert "nothing was written" in line and fs.objects == {}  # the probe's object removed all the same
    with pytest.raises(StoreError):  # refused again: a refusal is not remembered as a pass
        objects.check_honoured("s3://bucket/hs.zarr", locks)


def test_a_store_that_answers_a_conditional_put_with_an_error_is_one_line():
    fs = MemoryS3(
        answer=_failed("NotImplemented", "A header you provided implies functionality that is not implemented")
    )
    with pytest.raises(StoreError, match=r"answered a create with If-None-Match: \* with: A header you provided"):
        S3Objects(fs).check_honoured("s3://bucket/hs.zarr", folder())
    assert fs.objects == {}


def test_a_store_that_refuses_every_create_is_one_line():
    """A gateway that answers 412 to any If-None-Match: no lease could ever be won (extraction would wait
    an hour for the root's)."""

    class Refusing(MemoryS3):
        def pipe_file(self, path, data, mode="overwrite", IfMatch=None):
            if mode == "create":
                self.requests.append(("PUT", path, NONE_MATCH))
                raise _failed("PreconditionFailed", "At least one of the pre-conditions you specified did not hold")
            return super().pipe_file(path, data, mode, IfMatch)

    with pytest.raises(StoreError, match="refused to create a new object, .*/probe-.*, with If-None-Match"):
        S3Objects(Refusing()).check_honoured("s3://bucket/hs.zarr", folder())


@pytest.mark.parametrize("ignore", [(), (NONE_MATCH,), (MATCH,)])
def test_extractions_writer_takes_no_lease_on_a_store_that_ignores_the_conditions(ignore, monkeypatch):
    """store/store_writer.StoreWriter: `check_leases` (extraction's start-up) and every lease it hands
    out go through the probe; on a store that drops a condition nothing is taken, nothing written."""
    from store import store_writer

    fs = MemoryS3(ignore)
    monkeypatch.setattr(store_writer, "conditional_objects", lambda _: S3Objects(fs))
    store = store_writer.StoreWriter(f"memory://probe-{uuid.uuid4().hex[:8]}/hs.zarr")
    assert store.leased
    if not ignore:
        store.check_leases()
        lock = store.lock("00000")
        assert isinstance(lock, ObjectLease) and lock.path == store.path("_locks/00000.lock")
        assert len(fs.requests) == 5 and fs.requests[0][1].startswith(store.path("_locks/probe-"))
        return
    for attempt in (store.check_leases, lambda: store.lock("00000"), lambda: store.lock("root")):
        with pytest.raises(StoreError, match=f"^{store.location}: the object store at .* ignores"):
            attempt()
    assert fs.objects == {} and not store.fs.exists(store.root)
    assert {p.rsplit("/", 1)[-1].split("-")[0] for _, p, _ in fs.requests} == {"probe"}  # no lease asked for
