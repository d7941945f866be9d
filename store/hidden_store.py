"""The store as a whole: root creation and compatibility, shard status, commit files, locks.

A local path or any fsspec URL zarr accepts. Commit files are written last and atomically (a
temporary name, then a rename; on object stores a single put), so a reader or a rerun only
trusts what was finished. Locks need a POSIX file system; on object stores each process must
be given disjoint shard ranges.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import fsspec
import numpy as np
import torch
import zarr
from fsspec.implementations.local import LocalFileSystem

from store import layout
from store.errors import NotAStore, NotCommitted, StoreCorrupt, StoreError, StoreMismatch
from store.locks import HOST, LockFile
from store.ranges import format_ranges
from store.schema import SCHEMA_VERSION, Compat, ShardCommit, StoreAttrs, to_json

ROOT_LOCK_TIMEOUT_S = 3600.0


class HiddenStore:
    def __init__(self, location: str) -> None:
        self.location = str(location)
        self.fs, self.root = fsspec.core.url_to_fs(self.location)
        self.local = isinstance(self.fs, LocalFileSystem)

    # -- files -----------------------------------------------------------------------------
    def path(self, key: str) -> str:
        """The file system path of a key in the store."""
        return f"{self.root.rstrip('/')}/{key}"

    def read_json(self, key: str) -> dict | None:
        try:
            with self.fs.open(self.path(key), "r") as fh:
                return json.load(fh)
        except FileNotFoundError:
            return None
        except ValueError:
            return None  # a torn file from a crash counts as absent

    def write_json(self, key: str, obj: dict) -> None:
        data = json.dumps(obj, indent=1, sort_keys=True, default=str)
        path = self.path(key)
        if self.local:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            tmp = f"{path}.tmp.{os.getpid()}"
            try:
                with open(tmp, "w") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, path)
            except BaseException:  # a full disk, a signal: no temporary file left behind
                Path(tmp).unlink(missing_ok=True)
                raise
        else:
            with self.fs.open(path, "w") as fh:
                fh.write(data)

    def lock(self, name: str) -> LockFile | None:
        return LockFile(Path(self.path(f"_locks/{name}.lock"))) if self.local else None

    def exists(self) -> bool:
        return self.read_json(layout.commit_key("root")) is not None

    # -- root ------------------------------------------------------------------------------
    def group(self, mode: str = "r") -> zarr.Group:
        return zarr.open_group(self.location, mode=mode)

    @property
    def attrs(self) -> StoreAttrs:
        """The root attributes (read once, checked on the way in)."""
        if not hasattr(self, "_attrs"):
            if not self.exists():
                raise NotAStore(f"{self.location}: not a hidden-state store (no {layout.commit_key('root')})")
            self._attrs = StoreAttrs.from_json(dict(self.group("r").attrs), self.location)
        return self._attrs

    def create_or_check(self, attrs: StoreAttrs, embed: torch.Tensor, lm_head: torch.Tensor) -> str:
        """Create the root once (under a lock), or check an existing root matches `attrs.compat`.

        Returns "created" or "opened". embed, lm_head: [V, H] bf16.
        """
        lock = self.lock("root")
        if lock is not None:
            try:
                lock.acquire(ROOT_LOCK_TIMEOUT_S)
            except TimeoutError as e:
                raise StoreError(f"{self.location}: timed out waiting for the root lock ({e})") from None
        try:
            if self.exists():
                self.check_compatible(attrs.compat)
                return "opened"
            self._create(attrs, embed, lm_head)
            return "created"
        finally:
            if lock is not None:
                lock.release()

    def _create(self, attrs: StoreAttrs, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        if self.fs.exists(self.path("shards")) and self.fs.ls(self.path("shards")):
            raise NotAStore(f"{self.location}: has shard data but no root commit; not a store this tool made")
        g = zarr.open_group(self.location, mode="a")
        checksums = {}
        for name, w in (("embed_tokens", embed), ("lm_head", lm_head)):
            bits = layout.to_bits(w.detach().to("cpu", torch.bfloat16))
            rows = max(1, min(bits.shape[0], (1 << 24) // max(1, bits.shape[1] * 2)))
            g.create_array(f"target/{name}", shape=bits.shape, dtype=np.uint16, chunks=(rows, bits.shape[1]),
                           compressors=layout.hidden_codecs(attrs.compat.codec or "blosc", attrs.compat.compression_level),
                           fill_value=0, overwrite=True)[:] = bits
            checksums[name] = layout.crc32(bits)
        g.attrs.put(to_json(attrs))
        self.write_json(layout.commit_key("root"), {"time": time.time(), "host": HOST, "fingerprint": attrs.fingerprint,
                                                    "checksums": checksums})

    def check_compatible(self, compat: Compat) -> None:
        if self.attrs.schema_version < SCHEMA_VERSION:
            raise StoreMismatch(f"{self.location} is a schema-{self.attrs.schema_version} store (an earlier "
                                f"dflash-pipeline's layout): training and evaluation still read it, but new shards "
                                f"go into a new store (schema {SCHEMA_VERSION})")
        diff = self.attrs.compat.differences(compat)
        if diff:
            detail = "; ".join(f"{k}: store has {_short(a)}, this run has {_short(b)}" for k, (a, b) in sorted(diff.items()))
            raise StoreMismatch(f"{self.location} was made with a different target/taps/config, refusing to add shards "
                                f"({detail})")

    def embedding(self, name: str) -> torch.Tensor:
        """'embed_tokens' or 'lm_head': [V, H] bf16."""
        g = self.group("r")
        key = f"target/{name}"
        if key not in g:
            raise StoreCorrupt(f"{self.location}: missing array {key}")
        return layout.from_bits(g[key][:])

    # -- shards ----------------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return self.attrs.num_shards

    def commit_record(self, shard: int) -> ShardCommit | None:
        """Shard's commit record, or None while it is not committed."""
        d = self.read_json(layout.commit_key(shard))
        return None if d is None else ShardCommit.from_json(d, f"{self.location}: {layout.commit_key(shard)}")

    def write_commit(self, record: ShardCommit) -> None:
        """Commit a shard: its record, written last and atomically."""
        self.write_json(layout.commit_key(record.shard), record.to_json())

    def require_committed(self, shards: list[int]) -> None:
        """Every shard in `shards` must be committed; the error names the missing ones and the fix."""
        missing = [s for s in shards if self.commit_record(s) is None]
        if missing:
            text = format_ranges(missing)
            what = f"shard {text} is" if len(missing) == 1 else f"shards {text} are"
            raise NotCommitted(f"{self.location}: {what} not committed (run `pipeline extract --shards {text}` first)")

    def committed(self) -> dict[int, ShardCommit]:
        """Shard id -> its commit record, for every committed shard."""
        out = {}
        try:
            names = self.fs.ls(self.path("_commits"), detail=False)
        except FileNotFoundError:
            return out
        for name in names:
            base = name.rstrip("/").rsplit("/", 1)[-1]
            if base.endswith(".json") and base[:-5].isdigit():
                rec = self.commit_record(int(base[:-5]))
                if rec is not None:
                    out[int(base[:-5])] = rec
        return dict(sorted(out.items()))

    def has_data(self, shard: int) -> bool:
        return self.fs.exists(self.path(layout.shard_group(shard)))

    def clear_shard(self, shard: int) -> None:
        """Remove a shard's arrays and commit file (a rerun redoes it from scratch)."""
        for key in (layout.commit_key(shard), layout.shard_group(shard)):
            if self.fs.exists(self.path(key)):
                self.fs.rm(self.path(key), recursive=True)

    def shard_arrays(self, shard: int) -> zarr.Group:
        return zarr.open_group(self.location, mode="r", path=layout.shard_group(shard))

    def write_pieces(self, key: str, pieces: list) -> None:
        """Write a file made of byte pieces, in order (no joined copy)."""
        path = self.path(key)
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        with self.fs.open(path, "wb") as fh:
            for piece in pieces:
                fh.write(piece)

    def bytes_on_disk(self, key: str = "") -> int:
        """Bytes under key (the whole store by default)."""
        return sum(self._file_sizes(key).values())

    def shard_bytes(self, shard: int) -> dict[str, int]:
        """{"shard": all of a shard's files, "hidden": its states}, in bytes, from one walk."""
        sizes = self._file_sizes(layout.shard_group(shard))
        return {"shard": sum(sizes.values()), "hidden": sum(n for f, n in sizes.items() if f.startswith("hidden/"))}

    def _file_sizes(self, key: str) -> dict[str, int]:
        """Path under key -> bytes, for every file under key. Other processes may be writing the
        store meanwhile: a file that vanishes during the walk (a temp file renamed, a shard
        cleared) is simply not counted."""
        path = (self.path(key) if key else self.root).rstrip("/")
        if self.local:
            return _local_sizes(path)
        for attempt in range(5):
            try:
                if not self.fs.exists(path):
                    return {}
                return {f[len(path) + 1:]: int(n) for f, n in self.fs.du(path, total=False).items()}
            except FileNotFoundError:
                if attempt == 4:
                    raise
                time.sleep(0.1)


def _local_sizes(path: str) -> dict[str, int]:
    sizes = {}
    for folder, _, files in os.walk(path):
        for name in files:
            full = os.path.join(folder, name)
            try:
                sizes[os.path.relpath(full, path)] = os.lstat(full).st_size
            except FileNotFoundError:
                pass
    return sizes


def _short(v) -> str:
    text = json.dumps(v, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
