"""The node-local cache of an object store's files (store/io/node_cache.py): reads through it equal reads
without it, a cached file is read with no request to the store, the bound and the LRU order hold,
processes sharing one directory read correct bytes and leave it consistent, a damaged copy is read
again from the store, and a re-committed shard is not served from its old copies. The "object
store" here is fsspec's memory file system (a HiddenStore on it reads as from any remote store)
or, for several processes, local files fetched through a file system the cache treats as remote."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import random
import sqlite3
import threading
import time
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

from store.errors import ConfigError, StoreCorrupt
from store.hidden_store import HiddenStore
from store.io import node_cache
from store.io.node_cache import NodeCache
from store.shard_reader import ShardReader
from store.shard_writer import ShardWriter
from tests.store.io.node_cache_files import Files, fill, read, reader
from tests.store.test_shard_writer import TAPS, H, batches, fresh_store, write


def upload(local: Path, keys: list[str] | None = None, root: str | None = None) -> str:
    """Copy a local store (or some of its files) into the memory file system; its location."""
    root = root or f"/nc-{uuid.uuid4().hex}/s.zarr"
    mem = fsspec.filesystem("memory")
    for f in sorted(local.rglob("*")):
        key = str(f.relative_to(local))
        if f.is_file() and (keys is None or any(key.startswith(k) for k in keys)):
            mem.pipe_file(f"{root}/{key}", f.read_bytes())
    return f"memory://{root}"


def samples(store: HiddenStore) -> list:
    return [
        (s.tokens, s.loss_mask, s.hidden.view(torch.int16))
        for shard in sorted(store.committed())
        for s in ShardReader(store, shard)
    ]


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(all(torch.equal(x, y) for x, y in zip(p, q)) for p, q in zip(a, b))


def requests(monkeypatch, fs) -> list[str]:
    """The paths of every request the (memory) file system answers from now on."""
    sent = []
    real = fs.cat_file

    def counted(path, *args, **kwargs):
        sent.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(fs, "cat_file", counted)
    return sent


def is_data(path: str) -> bool:
    """A chunk or shard file of a sample's per-token arrays (what reads fetch through the cache)."""
    return any(f"/{name}/c{sep}" in path for name in ("hidden", "tokens", "loss_mask") for sep in "/.")


def cached_files(cache: NodeCache) -> dict[str, int]:
    """Cache-relative path -> bytes of every cached copy on disk (not the index, the bound's record, temp
    files or markers)."""
    out = {}
    for folder, dirs, files in os.walk(cache.root):
        dirs[:] = [d for d in dirs if d not in (".tmp", ".filling")]
        for name in files:
            if not name.startswith("index.sqlite") and not (folder == cache.root and name == node_cache.BOUND):
                full = os.path.join(folder, name)
                out[os.path.relpath(full, cache.root)] = os.path.getsize(full)
    return out


def index_rows(cache: NodeCache) -> tuple[dict[str, int], int]:
    db = sqlite3.connect(os.path.join(cache.root, "index.sqlite"))
    rows = dict(db.execute("SELECT key, bytes FROM files"))
    total = db.execute("SELECT bytes FROM total").fetchone()[0]
    db.close()
    return rows, total


def test_reads_through_the_cache_equal_uncached_reads_and_a_second_read_sends_none(small_store, tmp_path, monkeypatch):
    location = upload(small_store)
    expected = samples(HiddenStore(str(small_store)))
    cache = NodeCache(str(tmp_path / "cache"), 1 << 30)
    first = HiddenStore(location, node_cache=cache)
    sent = requests(monkeypatch, first.fs)
    assert first.node is not None and same(samples(first), expected)
    data = [p for p in sent if is_data(p)]
    assert data and len(data) == len(set(data))  # each data file fetched once, whole
    assert set(cached_files(cache)) == set(index_rows(cache)[0]) and len(cached_files(cache)) == len(data)
    sent.clear()
    again = HiddenStore(location, node_cache=NodeCache(cache.root, 1 << 30))  # another process's handle
    assert same(samples(again), expected)
    assert not [p for p in sent if is_data(p)]
    assert sent  # the shards' metadata and the root are read from the store (not cached)


def test_a_local_store_ignores_the_cache(small_store, tmp_path):
    cache = NodeCache(str(tmp_path / "cache"), 1 << 30)
    store = HiddenStore(str(small_store), node_cache=cache)
    assert store.node is None and same(samples(store), samples(HiddenStore(str(small_store))))
    assert cached_files(cache) == {}


def test_a_damaged_cached_copy_is_read_again_from_the_store(small_store, tmp_path):
    location = upload(small_store)
    expected = samples(HiddenStore(str(small_store)))
    cache = NodeCache(str(tmp_path / "cache"), 1 << 30)
    samples(HiddenStore(location, node_cache=cache))
    states = {k: n for k, n in cached_files(cache).items() if "/hidden/" in k}
    key = max(states, key=states.get)
    path = Path(cache.root, key)
    good = path.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 3] ^= 0xFF  # inside a chunk: its crc32c fails
    path.write_bytes(bytes(bad))
    assert same(samples(HiddenStore(location, node_cache=cache)), expected)  # not an error
    assert path.read_bytes() == good  # the copy replaced by the store's


def test_damage_in_the_store_itself_is_still_reported(small_store, tmp_path):
    location = upload(small_store)
    cache = NodeCache(str(tmp_path / "cache"), 1 << 30)
    store = HiddenStore(location, node_cache=cache)
    mem, path = store.fs, store.path("shards/00000/hidden/c.0.0.0")  # format revision 5's key
    data = bytearray(mem.cat_file(path))
    data[len(data) // 3] ^= 0xFF
    mem.pipe_file(path, bytes(data))
    with pytest.raises(StoreCorrupt, match="crc32c"):
        samples(store)


def test_a_recommitted_shard_is_not_served_from_its_old_copies(small_store, tmp_path):
    """Shard 1 written, read through the cache, then written again with other states (as --redo
    does: the same file names, a new commit record): the second read gets the new states."""
    stores = []
    for name, sign in (("a", 1), ("b", -1)):
        (tmp_path / name).mkdir()
        store = fresh_store(tmp_path / name, small_store)
        writer = ShardWriter(store, 1, TAPS, H, chunk_tokens=8, shard_tokens=32)
        write(writer, [sign * p for p in batches(4)])
        writer.commit(None, run={})
        stores.append(tmp_path / name / "copy.zarr")
    location = upload(stores[0])
    cache = NodeCache(str(tmp_path / "cache"), 1 << 30)
    old = [s.hidden.view(torch.int16) for s in ShardReader(HiddenStore(location, node_cache=cache), 1)]
    upload(stores[1], ["shards/00001", "_commits/00001.json"], root=location.removeprefix("memory://"))
    new = [s.hidden.view(torch.int16) for s in ShardReader(HiddenStore(location, node_cache=cache), 1)]
    want = [s.hidden.view(torch.int16) for s in ShardReader(HiddenStore(str(stores[1])), 1)]
    assert all(torch.equal(x, y) for x, y in zip(new, want)) and not torch.equal(old[0], new[0])


def test_the_bound_holds_and_the_least_recently_used_files_go_first(tmp_path, monkeypatch):
    monkeypatch.setattr(node_cache, "TOUCH_EVERY_S", 0.0)  # every use recorded (a process records one a minute)
    files = Files(tmp_path, 40, 1000)
    cache = NodeCache(str(tmp_path / "cache"), 3500)
    view = files.view(cache)
    f = files.paths
    for p in f[:3]:
        read(view, [p])
    read(view, [f[0]])  # f0 used again: f1 is now the least recently used
    read(view, [f[3]])
    on_disk = {Path(k).name for k in cached_files(cache)}
    assert on_disk == {"f0", "f2", "f3"}
    for p in random.Random(0).choices(f, k=200):
        assert read(view, [p], 10, 20) == [Path(p).read_bytes()[10:20]]
        assert sum(cached_files(cache).values()) <= 3500
    rows, total = index_rows(cache)
    assert rows == cached_files(cache) and total == sum(rows.values())


def test_ranges_of_a_cached_file_are_its_bytes(tmp_path):
    files = Files(tmp_path, 2, 5000)
    view = files.view(NodeCache(str(tmp_path / "cache"), 1 << 20))
    want = Path(files.paths[0]).read_bytes()
    for _ in range(2):  # fetched whole, then read from the cached copy
        got = view.fetch(
            LocalFileSystem(),
            [
                (files.paths[0], 100, 900),
                (files.paths[0], -20, None),
                (files.paths[0], 0, None),
                (str(tmp_path / "nope"), 0, None),
            ],
        )
        assert [bytes(g) for g in got[:3]] == [want[100:900], want[-20:], want]
        assert isinstance(got[3], FileNotFoundError)


def test_processes_sharing_one_cache_read_correct_bytes_and_leave_it_consistent(tmp_path):
    files = Files(tmp_path, 30, 4096)
    root = str(tmp_path / "cache")
    NodeCache(root, 12 * 4096)
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        wrong = pool.starmap(reader, [(root, str(files.folder), 30, seed) for seed in range(4)])
    assert wrong == [0, 0, 0, 0]
    cache = NodeCache(root, 12 * 4096)
    rows, total = index_rows(cache)
    assert rows == cached_files(cache) and total == sum(rows.values()) <= 12 * 4096
    assert os.listdir(os.path.join(root, ".tmp")) == [] and os.listdir(os.path.join(root, ".filling")) == []


def test_a_file_evicted_just_before_its_read_is_read_from_the_store(tmp_path, monkeypatch):
    """Another process evicts a file between this one's look and its read: the read gets the store's
    bytes, no error, and nothing is recorded for the missing copy."""
    files = Files(tmp_path, 2, 3000)
    cache = NodeCache(str(tmp_path / "cache"), 1 << 20)
    view = files.view(cache)
    read(view, files.paths)
    cache.drop([view.local(files.paths[0])])  # as an eviction does: the file, then its row
    monkeypatch.setattr(node_cache.os.path, "exists", lambda p: True)  # it was there when looked for
    want = Path(files.paths[0]).read_bytes()
    assert read(view, files.paths, 5, 50) == [want[5:50], Path(files.paths[1]).read_bytes()[5:50]]
    monkeypatch.undo()
    assert (
        set(index_rows(cache)[0])
        == set(cached_files(cache))
        == {os.path.relpath(view.local(files.paths[1]), cache.root)}
    )


def test_a_file_another_process_is_fetching_is_waited_for_not_fetched_again(tmp_path, monkeypatch):
    files = Files(tmp_path, 1, 2000)
    cache = NodeCache(str(tmp_path / "cache"), 1 << 20)
    view = files.view(cache)
    path, data = view.local(files.paths[0]), Path(files.paths[0]).read_bytes()
    marker = node_cache._marker(cache.root, path)
    assert cache.ready()  # the directory, made by the first fetch (the other process's here)
    Path(marker).touch()  # the other process's fill lock

    def other() -> None:
        time.sleep(0.3)
        NodeCache(cache.root, 1 << 20)._put({path: data})
        os.unlink(marker)

    fetching = threading.Thread(target=other)
    fetching.start()
    fs = LocalFileSystem(skip_instance_cache=True)
    sent = requests(monkeypatch, fs)
    assert bytes(view.fetch(fs, [(files.paths[0], 0, None)])[0]) == data and sent == []
    fetching.join()
    os.remove(path)
    cache.drop([path])
    Path(marker).touch()
    os.utime(marker, (0, 0))  # a lock left by a process that died: taken over, no wait
    assert bytes(view.fetch(fs, [(files.paths[0], 0, None)])[0]) == data and sent == [files.paths[0]]


def test_a_cache_that_cannot_be_written_is_read_through_and_said_once(tmp_path):
    """The directory cannot be made (a file in the way, as a full disk refuses it): every read is the
    store's bytes, nothing is made, and warn is told once why."""
    files = Files(tmp_path, 3, 3000)
    (tmp_path / "in-the-way").write_bytes(b"")
    said = []
    cache = NodeCache(str(tmp_path / "in-the-way" / "cache"), 1 << 20, warn=said.append)
    view = files.view(cache)
    for _ in range(2):
        assert read(view, files.paths, 7, 70) == [Path(p).read_bytes()[7:70] for p in files.paths]
    assert len(said) == 1 and said[0] == cache.trouble and "cannot be written (Not a directory)" in said[0]


# -- the bound belongs to the directory ------------------------------------------------------------
def bound_record(root: str) -> dict:
    return json.loads(Path(root, node_cache.BOUND).read_text())


def test_a_later_process_with_a_smaller_size_does_not_evict_below_the_directorys_bound(tmp_path):
    """A training (10 files' worth) fills the cache; an evaluation on the same node given a fifth of
    that reads two more files: it evicts to the training's bound, not its own, so the training's
    files stay. Two real processes, one after the other (each opens the directory as a new process)."""
    files = Files(tmp_path, 20, 1000)
    root = str(tmp_path / "cache")
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        trained = pool.apply(fill, (root, str(files.folder), 20, 10_000, list(range(8))))
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        evaluated = pool.apply(fill, (root, str(files.folder), 20, 2_000, [8, 9]))
    cache = NodeCache(root, 10_000)
    on_disk = {Path(k).name for k in cached_files(cache)}
    assert on_disk == {f"f{i}" for i in range(10)}  # the evaluation evicted nothing (old code: kept f8, f9)
    assert (trained, evaluated) == (10_000, 10_000)
    rows, total = index_rows(cache)
    assert total == sum(rows.values()) == 10_000 and bound_record(root)["max_bytes"] == 10_000


def test_the_recorded_bound_applies_to_every_later_cache_object_and_its_workers(tmp_path, monkeypatch):
    monkeypatch.setattr(node_cache, "TOUCH_EVERY_S", 0.0)
    files = Files(tmp_path, 12, 1000)
    root = str(tmp_path / "cache")
    first = NodeCache(root, 4000)
    assert not os.path.exists(root)  # nothing made before the first fetch, the bound included
    for p in files.paths[:4]:
        read(files.view(first), [p])
    assert bound_record(root)["max_bytes"] == 4000 and first.overruled() is None
    smaller, larger = NodeCache(root, 1000), NodeCache(root, 1 << 30)
    assert (smaller.max_bytes, larger.max_bytes) == (4000, 4000)
    line = smaller.overruled()
    assert line == (
        f"--cache-size 1000 not applied: --cache-dir {root} keeps the bound recorded in it, 4000 "
        "(bound.json, written by the first process that used the directory), and this process evicts only "
        f"beyond that; to change the bound, delete {root}/bound.json while no process uses the directory "
        "(the next run records its --cache-size), or leave --cache-size out"
    )
    assert "--cache-size 1G not applied" in larger.overruled()
    read(files.view(smaller), [files.paths[4]])
    assert len(cached_files(smaller)) == 4 and sum(cached_files(smaller).values()) == 4000
    read(files.view(larger), files.paths[5:9])  # a larger size is not applied either: the bound stays 4000
    assert sum(cached_files(larger).values()) == 4000
    worker = pickle.loads(pickle.dumps(smaller))  # as a loader worker gets it
    assert worker.max_bytes == 4000 and worker.overruled() is None
    assert bound_record(root)["max_bytes"] == 4000


def test_of_two_processes_arriving_together_the_first_ones_bound_is_recorded_and_the_other_is_told(tmp_path):
    """Both open a new directory (no record yet, each takes its own size for now); the first to write
    records its bound, the other adopts it at its first write and says so once."""
    files = Files(tmp_path, 4, 1000)
    root, said = str(tmp_path / "cache"), []
    a, b = NodeCache(root, 3000), NodeCache(root, 1000, warn=said.append)
    assert (a.max_bytes, b.max_bytes) == (3000, 1000)
    read(files.view(a), files.paths[:3])
    read(files.view(b), [files.paths[3]])
    read(files.view(b), files.paths[:2])
    assert b.max_bytes == 3000 and said == [b.overruled()] and "--cache-size 1000 not applied" in said[0]
    assert sum(cached_files(a).values()) == 3000 and bound_record(root)["max_bytes"] == 3000
    assert os.listdir(os.path.join(root, ".tmp")) == []


def test_a_deleted_record_lets_the_next_process_record_its_bound(tmp_path):
    files = Files(tmp_path, 6, 1000)
    root = str(tmp_path / "cache")
    read(files.view(NodeCache(root, 5000)), files.paths[:5])
    os.remove(os.path.join(root, node_cache.BOUND))  # the documented way to change it, while no process uses it
    smaller = NodeCache(root, 2000)
    assert smaller.overruled() is None
    read(files.view(smaller), [files.paths[5]])
    assert bound_record(root)["max_bytes"] == 2000 and sum(cached_files(smaller).values()) == 2000


@pytest.mark.parametrize(
    "text, got",
    [
        ("", "no JSON object"),
        ("[1]", "no JSON object"),
        ('{"max_bytes": "8T"}', "max_bytes '8T'"),
        ("{}", "max_bytes None"),
    ],
)
def test_a_record_that_does_not_read_as_one_is_one_line_naming_it(tmp_path, text, got):
    root = tmp_path / "cache"
    root.mkdir()
    (root / "bound.json").write_text(text)
    with pytest.raises(ConfigError) as e:
        NodeCache(str(root), 1 << 20)
    assert str(e.value) == (
        f"--cache-dir {root}: {root}/bound.json holds {got}, expected the directory's bound as a positive "
        "number of bytes (max_bytes); delete that file while no process uses the directory: the next run "
        "records its --cache-size there"
    )
