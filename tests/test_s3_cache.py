"""The node-local cache (store/io/node_cache.py) in front of a real S3 API (moto's server on 127.0.0.1,
s3fs): reads through it are the store's bytes, a file is fetched from the store once per node
however often it is read (two epochs of training, several processes), and a damaged local copy is
read again from the store. Opt-in: `pytest -m s3`."""

import multiprocessing
import re

import pytest

from store.hidden_store import HiddenStore
from store.io.node_cache import NodeCache
from tests.processes import train
from tests.store.io.node_cache_files import digest
from tests.store.io.test_node_cache import cached_files, index_rows, is_data, same, samples

pytestmark = pytest.mark.s3


def put(local, location: str) -> str:
    import fsspec

    fsspec.filesystem("s3").put(str(local), location.removeprefix("s3://"), recursive=True)
    return location


def gets(s3, since: int) -> list[str]:
    """The paths of the GETs the server answered after its first `since` log lines."""
    lines = s3.log.read_text(errors="replace").splitlines()[since:]
    return [m.group(1) for m in (re.search(r'"(?:\x1b\[[0-9;]*m)*GET (/[^ ?]+)', line) for line in lines) if m]


def log_lines(s3) -> int:
    return len(s3.log.read_text(errors="replace").splitlines())


def test_a_second_read_sends_no_data_request(s3, small_store, tmp_path):
    location = put(small_store, "s3://bucket/read.zarr")
    expected = samples(HiddenStore(str(small_store)))
    root = str(tmp_path / "cache")
    mark = log_lines(s3)
    assert same(samples(HiddenStore(location, node_cache=NodeCache(root, 1 << 30))), expected)
    first = [p for p in gets(s3, mark) if is_data(p)]
    assert first and len(first) == len(set(first))  # each file once, whole
    mark = log_lines(s3)
    assert same(samples(HiddenStore(location, node_cache=NodeCache(root, 1 << 30))), expected)
    assert [p for p in gets(s3, mark) if is_data(p)] == []
    cache = NodeCache(root, 1 << 30)
    assert cached_files(cache) == index_rows(cache)[0] and len(cached_files(cache)) == len(first)


def test_a_damaged_copy_is_read_again_from_s3(s3, small_store, tmp_path):
    location = put(small_store, "s3://bucket/damaged.zarr")
    cache = NodeCache(str(tmp_path / "cache"), 1 << 30)
    expected = samples(HiddenStore(location, node_cache=cache))
    path = max((p for p in cached_files(cache) if "/hidden/" in p), key=lambda p: cached_files(cache)[p])
    full = tmp_path / "cache" / path
    data = bytearray(full.read_bytes())
    data[len(data) // 2] ^= 0x55
    full.write_bytes(bytes(data))
    mark = log_lines(s3)
    assert same(samples(HiddenStore(location, node_cache=cache)), expected)
    parts = path.split("/")  # <store>/shards/00000/<commit>/hidden/...
    assert [p for p in gets(s3, mark) if is_data(p)] == ["/bucket/damaged.zarr/" + "/".join(parts[1:3] + parts[4:])]


def test_processes_sharing_a_cache_read_the_store_once(s3, small_store, tmp_path):
    location = put(small_store, "s3://bucket/shared.zarr")
    root = str(tmp_path / "cache")
    NodeCache(root, 1 << 30)
    mark = log_lines(s3)
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        got = pool.starmap(digest, [(location, root)] * 3)
    assert len(set(got)) == 1 and got[0] == digest(str(small_store), str(tmp_path / "unused"))
    data = [p for p in gets(s3, mark) if is_data(p)]
    assert len(data) == len(set(data))  # fill locks: no file fetched twice
    cache = NodeCache(root, 1 << 30)
    assert cached_files(cache) == index_rows(cache)[0] and len(cached_files(cache)) == len(data)


def test_two_epochs_of_training_fetch_each_file_once(s3, small_store, tmp_path):
    location = put(small_store, "s3://bucket/train.zarr")
    mark = log_lines(s3)
    t = train(
        [
            "--store",
            location,
            "--shards",
            "0-1",
            "--eval-shards",
            "2",
            "--out",
            tmp_path / "run",
            "--epochs",
            "2",
            "--workers",
            "1",
            "--anchors",
            "16",
            "--num-layers",
            "1",
            "--batch-size",
            "2",
            "--eval-replay-prompts",
            "0",
            "--cache-dir",
            tmp_path / "cache",
            "--cache-size",
            "1G",
        ]
    )
    assert t.returncode == 0, t.stderr[-3000:]
    trained = [p for p in gets(s3, mark) if is_data(p) and re.search(r"/shards/0000[01]/", p)]
    assert trained and len(trained) == len(set(trained))
    cache = NodeCache(str(tmp_path / "cache"), 1 << 30)
    assert cached_files(cache) == index_rows(cache)[0]
