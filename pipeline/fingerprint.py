"""Content hashes that say exactly which target, tokenizer and data made a store."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

CHUNK = 1 << 24
_CACHE = Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash-pipeline")) / "file-sha256.json"


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def sha256_json(obj) -> str:
    return sha256_text(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str))


def sha256_file(path: Path) -> str:
    """SHA-256 of a file, cached by (path, size, mtime) so large checkpoints hash once per machine."""
    path = Path(path).resolve()
    st = path.stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    cache = _load_cache()
    if key in cache:
        return cache[key]
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(CHUNK):
            h.update(block)
    digest = h.hexdigest()
    cache[key] = digest
    _save_cache(cache)
    return digest


def _load_cache() -> dict:
    try:
        return json.loads(_CACHE.read_text())
    except (OSError, ValueError):
        return {}


def _save_cache(cache: dict) -> None:
    try:
        _CACHE.parent.mkdir(parents=True, exist_ok=True)
        tmp = _CACHE.with_name(f"{_CACHE.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, _CACHE)
    except OSError:
        pass  # a cache that cannot be written only costs time
