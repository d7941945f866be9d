"""Numbered files fetched through a node-local cache as if from an object store, and a reader of
them for tests/store/io/test_node_cache.py's processes (a light module: a spawned process imports it)."""

from __future__ import annotations

import random
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem

from store.io.node_cache import NodeCache


class Files:
    """Numbered files of known bytes in a local folder, fetched through a cache as if remote."""

    def __init__(self, folder: Path, n: int, size: int, write: bool = True) -> None:
        self.folder = folder
        shard = folder / "s.zarr" / "shards" / "00000"
        self.paths = [str(shard / f"f{i}") for i in range(n)]
        if write:
            shard.mkdir(parents=True)
            for i, path in enumerate(self.paths):
                Path(path).write_bytes(random.Random(i).randbytes(size))

    def view(self, cache: NodeCache):
        view = cache.view("s3://bucket/s.zarr", str(self.folder / "s.zarr"))
        view.admit("shards/00000", _Record())
        return view


class _Record:
    def to_json(self) -> dict:
        return {"shard": 0, "checksums": {}}


def read(view, paths: list[str], start: int = 0, end: int | None = None) -> list:
    return [bytes(d) for d in view.fetch(LocalFileSystem(), [(p, start, end) for p in paths])]


def reader(root: str, folder: str, n: int, seed: int) -> int:
    """A process reading every file (whole and in part) in its own random order, several times; the
    number of wrong reads."""
    files = Files(Path(folder), n, 0, write=False)
    view = files.view(NodeCache(root, 12 * 4096))
    rng, wrong = random.Random(seed), 0
    for _ in range(4):
        batch = rng.sample(files.paths, n)
        for i in range(0, n, 5):
            part = batch[i : i + 5]
            a = rng.randrange(4096)
            got = read(view, part, a, a + 100) + read(view, part)
            want = [Path(p).read_bytes()[a : a + 100] for p in part] + [Path(p).read_bytes() for p in part]
            wrong += sum(g != w for g, w in zip(got, want))
    return wrong


def digest(location: str, cache_root: str) -> str:
    """A process reading every sample of a store through a cache: the SHA-256 of their tokens and states."""
    import hashlib

    import torch

    from store.hidden_store import HiddenStore
    from store.shard_reader import ShardReader

    store = HiddenStore(location, node_cache=NodeCache(cache_root, 1 << 30))
    h = hashlib.sha256()
    for shard in sorted(store.committed()):
        for s in ShardReader(store, shard):
            h.update(s.tokens.numpy().tobytes())
            h.update(s.hidden.view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def fill(root: str, folder: str, n: int, max_bytes: int, names: list[int]) -> int | None:
    """A process (a training's, an evaluation's) reading files `names` of the n in folder through the
    cache at root, given max_bytes: the bound it then evicts to."""
    files = Files(Path(folder), n, 0, write=False)
    cache = NodeCache(root, max_bytes)
    view = files.view(cache)
    for i in names:
        read(view, [files.paths[i]])
    return cache.max_bytes
