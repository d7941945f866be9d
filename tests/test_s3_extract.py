"""Extraction by many processes on one S3 store, through a real S3 API (moto's server on 127.0.0.1):
one creates the store while the others wait, shards are claimed under leases (store/io/object_lease.py),
a stopped writer's shard is taken over once its lease runs out; the same server behind a proxy that
drops the conditional headers (a store that ignores them) is refused before anything is written.
Opt-in: `pytest -m s3`."""

import re
import signal
import socket
import time

import pytest

from tests.conftest import assert_stores_equal
from tests.processes import pipeline_proc, run_pipeline
from tests.s3 import HeaderStripper, extract_args

pytestmark = pytest.mark.s3


@pytest.fixture(scope="module")
def one_process(s3, small_dataset) -> str:
    """Shards 0-3 extracted by one process: what any number of processes must make."""
    store = "s3://bucket/one.zarr"
    t0 = time.perf_counter()
    p = run_pipeline(extract_args(store, small_dataset, "0-3"))
    assert p.returncode == 0, p.stderr[-2000:]
    print(f"\none process, shards 0-3 of a new S3 store: {time.perf_counter() - t0:.1f} s")
    return store


def written(err: str) -> list[int]:
    """The shards a run says it wrote (its log, on stderr)."""
    return [int(s) for s in re.findall(r"^shard (\d+): \d+ samples", err, re.M)]


def test_an_object_lease_on_s3_is_exclusive_taken_over_after_it_runs_out_and_fenced(s3):
    import s3fs

    from store.io.object_lease import ObjectLease
    from store.io.s3_objects import S3Objects

    objects, path = S3Objects(s3fs.S3FileSystem()), "bucket/lease.zarr/_locks/x.lock"
    holder, taker = ObjectLease(objects, path, lease_s=2, heartbeat_s=3600), ObjectLease(objects, path, lease_s=2)
    assert holder.try_acquire() is None
    assert taker.try_acquire()["token"] == holder._record["token"]  # held: If-None-Match refused the create
    assert holder.still_held()  # renewed (If-Match on its own ETag)
    time.sleep(3.5)  # no heartbeat for longer than the lease, by the server's clock
    assert taker.try_acquire() is None  # taken over (If-Match on the stale ETag)
    assert not holder.still_held()  # the fence: the replaced holder's renewal is refused
    holder.release()  # its conditional delete leaves the taker's lease alone
    assert objects.read(path) is not None and taker.still_held()
    taker.release()
    assert objects.read(path) is None


IGNORED = (
    "ignores S3's conditional writes (If-None-Match: *: a second create of one object succeeded and "
    "If-Match: a replace with a stale ETag succeeded), on which extraction's leases rely"
)


def test_the_probe_passes_on_s3_and_refuses_a_store_that_drops_the_conditional_headers(s3):
    import s3fs

    from store.errors import StoreError
    from store.io import s3_objects

    s3_objects._HONOURED.clear()  # this process has probed no store yet
    s3_objects.S3Objects(s3fs.S3FileSystem(skip_instance_cache=True)).check_honoured("s3://p", "bucket/p.zarr/_locks")
    with HeaderStripper(s3.url) as proxy:
        fs = s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=proxy.url)
        with pytest.raises(StoreError) as e:
            s3_objects.S3Objects(fs).check_honoured("s3://p", "bucket/p.zarr/_locks")
        assert str(e.value).startswith(f"s3://p: the object store at {proxy.url} {IGNORED}")
        assert proxy.stripped == 3  # two creates' If-None-Match, the stale replace's If-Match
    assert s3fs.S3FileSystem(skip_instance_cache=True).find("bucket/p.zarr") == []  # both probes' objects removed


def test_extraction_on_a_store_that_ignores_conditional_writes_is_refused_before_anything_is_written(
    s3, small_dataset, one_process
):
    """The same extraction that passes on S3 (one_process), through a proxy that strips If-None-Match and
    If-Match: one line naming the store and what it ignored, exit 2, before the target loads and with
    nothing written (no root, no shard, no lease, no probe left)."""
    import s3fs

    store = "s3://bucket/ignored.zarr"
    with HeaderStripper(s3.url) as proxy:
        t0 = time.perf_counter()
        r = run_pipeline(extract_args(store, small_dataset, "0-3"), env={"FSSPEC_S3_ENDPOINT_URL": proxy.url})
        wall = time.perf_counter() - t0
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.startswith(f"error: {store}: the object store at {proxy.url} {IGNORED}")
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1  # that line alone: nothing ran before it
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    assert not fs.exists("bucket/ignored.zarr") and not fs.find("bucket/ignored.zarr")
    assert not [p for p in fs.find("bucket/one.zarr/_locks") if "/probe-" in p]  # the passing run's probe removed
    print(f"\nrefused through the header-stripping proxy in {wall:.1f} s: {r.stderr.strip()}")


def test_four_processes_extracting_one_new_store_make_what_one_process_makes(s3, small_dataset, one_process):
    store = "s3://bucket/four.zarr"
    t0 = time.perf_counter()
    procs = [pipeline_proc(extract_args(store, small_dataset, "0-3")) for _ in range(4)]
    outs = [p.communicate(timeout=600) for p in procs]
    wall = time.perf_counter() - t0
    assert [p.returncode for p in procs] == [0] * 4, [err[-2000:] for _, err in outs]
    assert not any("Traceback" in err for _, err in outs)
    states = [re.search(rf"store {store}: (created|opened|rebuilt);", err).group(1) for _, err in outs]
    assert sorted(states) == ["created", "opened", "opened", "opened"]  # one creator; the others waited for it
    shards = [written(err) for _, err in outs]
    assert sorted(s for w in shards for s in w) == [0, 1, 2, 3]  # every shard written once, by one process
    assert_stores_equal(one_process, store)
    print(
        f"\n4 processes, one new S3 store: {wall:.1f} s; shards written per process {shards}; "
        f"{s3.requests()} requests so far"
    )


def test_a_stopped_writers_shard_is_taken_over_after_its_lease_and_the_store_is_identical(
    s3, small_dataset, one_process
):
    """A writer stopped inside shard 1 (SIGSTOP: alive, its heartbeat silent, as a node that stopped
    answering) keeps it for its lease; a rerun within the lease leaves it, one after takes it over;
    then the stopped writer is killed (SIGKILL). The store equals one process's."""
    store, lease = "s3://bucket/stopped.zarr", 30
    stalled = pipeline_proc(extract_args(store, small_dataset, "0-3", "--lease-s", str(lease)), pause_after=3)
    deadline = time.time() + 300
    while time.time() < deadline and "PAUSED shard=1" not in stalled.stderr.readline():
        pass
    stalled.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        early = run_pipeline(extract_args(store, small_dataset, "1", "--lease-s", str(lease)))
        early_s = time.monotonic() - stopped
        assert early_s < lease, f"the early rerun took {early_s:.0f} s, past the lease: rerun with a longer one"
        assert early.returncode == 0 and written(early.stderr) == [], early.stderr[-2000:]
        assert f"left 1 to other live processes (1: {socket.gethostname()}:{stalled.pid})" in early.stdout, early.stdout
        time.sleep(max(0.0, stopped + lease + 2 - time.monotonic()))
        t0 = time.perf_counter()
        late = run_pipeline(extract_args(store, small_dataset, "0-3", "--lease-s", str(lease)))
        late_s = time.perf_counter() - t0
        assert late.returncode == 0, late.stderr[-2000:]
        assert written(late.stderr) == [1, 2, 3], late.stderr  # 0 was committed before the stop
    finally:
        stalled.send_signal(signal.SIGKILL)
        stalled.wait(timeout=30)
    assert_stores_equal(one_process, store)
    print(
        f"\nstopped writer: rerun within the lease left shard 1 ({early_s:.1f} s after the stop); "
        f"rerun after it took shard 1 over and completed the store in {late_s:.1f} s"
    )
