"""The store's index file: every commit record and per-sample array (offsets, first_pairs,
prompt_lens) of one state of the store's commits, in one file, so that a training launch or an
evaluation at thousands of shards reads a listing and one file instead of about five small files a
shard.

    STORE/_index/samples-<key>.npz    <key>: the state's digest (16 hex digits); the file: npz, then crc32c

A state is named by the listing of `_commits/`: every file's name, size and version as the file
system reports it without reading the file (an object store's ETag, on S3 the MD5 of its bytes for
a plain put, or its generation; a local file's inode and modification time). Any commit, redo or
removal changes the state, and the file of another state is never used. A file system whose
listing names no version gets no index file (every launch then reads the commit files).

Nothing in the file is trusted for its name alone: its crc32c, the state written inside it, every
commit record's own seal and every array's shape and CRC-32 against its commit record are checked
when it is read; a file that fails any check is treated as absent, built again and replaced. It is
a cache: deleting `_index/` loses nothing, and a store that cannot be written to (read-only
credentials) is read the long way with a warning.
"""

from __future__ import annotations

import hashlib
import io
import time
from dataclasses import dataclass

import google_crc32c
import numpy as np

from store.format import layout
from store.format.schema import ShardCommit
from store.hidden_store import HiddenStore
from store.io import commit_file
from store.sample_index import per_sample

FOLDER = "_index"
NAMES = ("offsets", "first_pairs", "prompt_lens")  # the per-sample arrays training and evaluation index by
# the listing fields that change when a file is rewritten: object stores' content or generation,
# local files' inode and modification time (a rewrite is a new file renamed into place)
VERSION_FIELDS = ("ETag", "etag", "md5Hash", "crc32c", "generation", "ino", "mtime")


@dataclass(frozen=True)
class StoreIndex:
    records: dict[int, ShardCommit]  # shard -> its commit record, every committed shard, in shard order
    arrays: dict[int, dict[str, np.ndarray]]  # shard -> {offsets: [N+1] int64, first_pairs, prompt_lens: [N] int32}


def load(store: HiddenStore) -> tuple[StoreIndex, str]:
    """(the index of every committed shard, one line saying where it came from). From the index
    file of the commits' present state when there is one that passes every check; else from the
    commit files and per-sample arrays (StoreCorrupt on a damaged commit file, as store.committed),
    then saved for the next launch when the state did not change meanwhile."""
    key = state(store)
    if key is not None:
        found = read(store, key)
        if found is not None:
            return found, f"sample index of {_shards(len(found.records))} read from {_shown(store, key)}"
    t = time.perf_counter()
    records = store.committed()
    index = StoreIndex(records, per_sample(store, records, NAMES))
    built = f"sample index of {_shards(len(records))} built from their files in {time.perf_counter() - t:.1f} s"
    if key is None:
        return index, f"{built} (this file system's listing names no file versions: no index file is kept)"
    if state(store) != key:
        return index, f"{built} (commits changed while it was read: not saved)"
    try:
        write(store, key, index)
    except OSError as e:
        return index, f"{built}; could not save it to {_shown(store, key)} ({e}): the next launch reads them again"
    return index, f"{built}, saved to {_shown(store, key)}"


def state(store: HiddenStore) -> str | None:
    """The digest of `_commits/`'s listing (names, sizes, versions); None when the listing names
    no version for some file or there is no such folder."""
    folder = store.path("_commits")
    store.fs.invalidate_cache(folder)  # a listing cached earlier in this process may be stale
    try:
        infos = store.fs.ls(folder, detail=True)
    except FileNotFoundError:
        return None
    rows = []
    for info in infos:
        version = [f"{k}={info[k]}" for k in VERSION_FIELDS if info.get(k) not in (None, "")]
        if not version:
            return None
        rows.append(" ".join([info["name"].rstrip("/").rsplit("/", 1)[-1], f"size={info.get('size')}", *version]))
    return hashlib.sha256("\n".join(sorted(rows)).encode()).hexdigest()[:16]


def file_key(key: str) -> str:
    return f"{FOLDER}/samples-{key}.npz"


def _shards(n: int) -> str:
    return f"{n:,} shard" + ("" if n == 1 else "s")


def _shown(store: HiddenStore, key: str) -> str:
    """The index file as the user named the store (an s3:// URL stays one)."""
    return f"{store.location.rstrip('/')}/{file_key(key)}"


def encode(key: str, index: StoreIndex) -> bytes:
    """The file's bytes: an npz of the state, the commit files' canonical JSON and the arrays
    (each flat, with its per-shard ends), then the crc32c of all of it."""
    shards = list(index.records)
    commits = [commit_file.canonical(commit_file.seal(index.records[s].to_json())) for s in shards]
    parts = {
        "state": np.frombuffer(key.encode(), np.uint8),
        "shards": np.array(shards, np.int64),
        "commits": np.frombuffer(b"".join(commits), np.uint8),
        "commits_ends": np.cumsum([len(c) for c in commits], dtype=np.int64),
    }
    for name in NAMES:
        arrays = [index.arrays[s][name] for s in shards]
        parts[name] = np.concatenate(arrays) if arrays else np.zeros(0, layout.ARRAY_DTYPES[name])
        parts[f"{name}_ends"] = np.cumsum([len(a) for a in arrays], dtype=np.int64)
    buf = io.BytesIO()
    np.savez_compressed(buf, **parts)
    body = buf.getvalue()
    return body + google_crc32c.value(body).to_bytes(4, "little")


def decode(data: bytes, key: str, where: str) -> StoreIndex | None:
    """The index in a file's bytes, or None when any check fails (see the module's docstring)."""
    body = data[:-4]
    if len(data) < 4 or int.from_bytes(data[-4:], "little") != google_crc32c.value(body):
        return None
    try:
        with np.load(io.BytesIO(body), allow_pickle=False) as z:
            parts = {k: z[k] for k in z.files}
        if parts["state"].tobytes().decode() != key:
            return None
        shards = parts["shards"].tolist()
        texts = np.split(parts["commits"], parts["commits_ends"][:-1])
        records = {
            s: ShardCommit.from_json(commit_file.parse(t.tobytes(), where), where) for s, t in zip(shards, texts)
        }
        arrays = {s: {} for s in shards}
        for name in NAMES:
            for s, a in zip(shards, np.split(parts[name], parts[f"{name}_ends"][:-1])):
                arrays[s][name] = a.astype(layout.ARRAY_DTYPES[name])
    except Exception:  # noqa: BLE001 - any unreadable content is a file that fails its checks
        return None
    for s, rec in records.items():
        for name, a in arrays[s].items():
            if name in rec.shapes and (
                list(a.shape) != list(rec.shapes[name]) or rec.checksums.get(name, layout.crc32(a)) != layout.crc32(a)
            ):
                return None
    return StoreIndex(records, arrays)


def read(store: HiddenStore, key: str) -> StoreIndex | None:
    """The index file of state `key`, or None when it is absent or fails a check."""
    path = store.path(file_key(key))
    try:
        data = store.fs.cat_file(path, start=0)  # start=0: one GET (commit_file.cat_many)
    except OSError:  # absent, or not readable here: the commit files are read instead
        return None
    return decode(data, key, path)


def write(store: HiddenStore, key: str, index: StoreIndex) -> None:
    """Save the index file of state `key` (atomically) and remove the files of other states."""
    path = store.path(file_key(key))
    commit_file.put_atomic(store.fs, path, encode(key, index), store.local)
    try:
        others = [p for p in store.fs.ls(store.path(FOLDER), detail=False) if p.rstrip("/") != path]
        for other in others:
            store.fs.rm(other)
    except FileNotFoundError:
        pass  # another process pruned them first
