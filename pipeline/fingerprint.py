"""Content hashes that say exactly which target, tokenizer and data made a store.

File hashes (a 27B checkpoint is 54 GB) are cached per (path, size, mtime), one small file per
entry under $DFLASH_CACHE (default ~/.cache/dflash-pipeline), and computed under a lock on that
entry: eight ranks starting together on one node hash a file once, and with $DFLASH_CACHE on a
file system all nodes share, once per cluster.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path

CHUNK = 1 << 24


def cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash-pipeline")) / "file-sha256"


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def sha256_json(obj) -> str:
    return sha256_text(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str))


def sha256_file(path: Path) -> str:
    """SHA-256 of a file, cached by (path, size, mtime) so large checkpoints hash once."""
    path = Path(path).resolve()
    st = path.stat()
    entry = cache_dir() / f"{sha256_text(f'{path}|{st.st_size}|{st.st_mtime_ns}')[:40]}.sha256"
    if (digest := _read(entry)) is not None:
        return digest
    with _locked(entry.with_suffix(".lock")):
        if (digest := _read(entry)) is None:  # another process may have finished it meanwhile
            digest = hash_file(path)
            _write(entry, digest)
    return digest


def hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        while block := fh.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def _read(entry: Path) -> str | None:
    try:
        text = entry.read_text().strip()
    except OSError:
        return None
    return text if len(text) == 64 else None


def _write(entry: Path, digest: str) -> None:
    try:  # a cache that cannot be written only costs time
        tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
        tmp.write_text(digest)
        os.replace(tmp, entry)
    except OSError:
        pass


@contextmanager
def _locked(path: Path):
    """An exclusive flock on path, or none where the cache cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path, "a")
    except OSError:
        yield
        return
    with fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield
