"""The store as a whole: root creation and compatibility, shard status, commit files, locks.

A local path or any fsspec URL zarr accepts. Commit files are written last and atomically (a
temporary name, then a rename; on object stores a single put), so a reader or a rerun only
trusts what was finished; they are sealed by their own checksum and record the checksums of the
metadata files zarr parses, which are checked before zarr reads them (store/commit_file.py).
Locks need a POSIX file system; on object stores each process must be given disjoint shard ranges.
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

from store import commit_file, layout
from store.errors import NotAStore, NotCommitted, StoreCorrupt, StoreError, StoreMismatch
from store.locks import HOST, LockFile
from store.ranges import format_ranges
from store.read_checks import ReadChecks, read_checks
from store.schema import SCHEMA_VERSION, Compat, RootCommit, ShardCommit, StoreAttrs, to_json

ROOT_LOCK_TIMEOUT_S = 3600.0
ROOT_METADATA = ("zarr.json", "target/zarr.json", "target/embed_tokens/zarr.json", "target/lm_head/zarr.json")
ROOT_FIX = ("the store's root is damaged (zarr.json, target/ or _commits/root.json; the shards are separate "
            "and `pipeline verify` checks them): rebuild it with `pipeline extract ... --redo` and the settings the "
            "store was made with, --num-shards included, or restore those files from a copy")


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
        """A commit file's record; None when it does not exist, StoreCorrupt when it is damaged."""
        return commit_file.read(self.fs, self.path(key))

    def write_json(self, key: str, obj: dict) -> None:
        """Write a commit file (sealed, atomically)."""
        commit_file.write(self.fs, self.path(key), obj, self.local)

    def lock(self, name: str) -> LockFile | None:
        return LockFile(Path(self.path(f"_locks/{name}.lock"))) if self.local else None

    def exists(self) -> bool:
        return self.fs.exists(self.path(layout.commit_key("root")))

    def read_checks(self, records: dict[int, ShardCommit] | None = None) -> ReadChecks:
        """What reading this store checks (store/read_checks.py); records: the commit records of the
        shards asked about (default: every committed one)."""
        return read_checks(self.location, self.attrs, self.root_commit, self.commits()[0] if records is None else records)

    def shard_damage(self, e: StoreCorrupt, shard: int, sample: int | None = None) -> StoreCorrupt:
        """e, told which shard (and sample) it lies in and what to run about it."""
        return e.located(f"shard {shard}" + ("" if sample is None else f", sample {sample}"), self.redo_hint(shard))

    def redo_hint(self, shard: int) -> str:
        """What to run about a damaged shard."""
        return (f"run `pipeline verify {self.location} --shards {shard}`, then re-extract it with the store's "
                f"settings (`pipeline info` shows them) and `--shards {shard} --redo`")

    # -- root ------------------------------------------------------------------------------
    def group(self, mode: str = "r") -> zarr.Group:
        return zarr.open_group(self.location, mode=mode)

    @property
    def root_commit(self) -> RootCommit:
        """The root's commit record (read once)."""
        if not hasattr(self, "_root_commit"):
            key = layout.commit_key("root")
            try:
                d = self.read_json(key)
                if d is None:
                    raise NotAStore(f"{self.location}: not a hidden-state store (no {key})")
                self._root_commit = RootCommit.from_json(d, self.path(key))
            except StoreCorrupt as e:
                raise e.located(None, ROOT_FIX) from None
        return self._root_commit

    @property
    def attrs(self) -> StoreAttrs:
        """The root attributes (read once, checked on the way in: the root's metadata files against
        the checksums its commit file records, the fingerprint against the one it repeats)."""
        if not hasattr(self, "_attrs"):
            root = self.root_commit
            try:
                commit_file.check_files(self.fs, self.root.rstrip("/"), root.metadata or {})
                raw = dict(self.group("r").attrs)
            except StoreCorrupt as e:
                raise e.located(None, ROOT_FIX) from None
            except Exception as e:  # noqa: BLE001 - zarr's own error on a root it cannot parse
                raise StoreCorrupt(f"{self.path('zarr.json')}: unreadable ({type(e).__name__}: {e})",
                                   ROOT_FIX) from None
            attrs = StoreAttrs.from_json(raw, self.location)
            if attrs.fingerprint != root.fingerprint:
                raise StoreCorrupt(f"{self.path('zarr.json')}: the attributes' fingerprint {attrs.fingerprint[:12]} is "
                                   f"not the {root.fingerprint[:12]} of {layout.commit_key('root')}", ROOT_FIX)
            self._attrs = attrs
        return self._attrs

    def create_or_check(self, attrs: StoreAttrs, embed: torch.Tensor, lm_head: torch.Tensor,
                        repair: bool = False) -> str:
        """Create the root once (under a lock), or check an existing root matches `attrs.compat`;
        with repair, a damaged root made with these settings is rebuilt first.

        Returns "created", "opened" or "rebuilt". embed, lm_head: [V, H] bf16.
        """
        lock = self.lock("root")
        if lock is not None:
            try:
                lock.acquire(ROOT_LOCK_TIMEOUT_S)
            except TimeoutError as e:
                raise StoreError(f"{self.location}: timed out waiting for the root lock ({e})") from None
        try:
            if self.exists():
                damage = self.root_damage() if repair else None
                if damage is not None:
                    self._rebuild(attrs, embed, lm_head, damage)
                    return "rebuilt"
                self.check_compatible(attrs.compat)
                return "opened"
            self._create(attrs, embed, lm_head)
            return "created"
        finally:
            if lock is not None:
                lock.release()

    def root_damage(self) -> str | None:
        """What is wrong with the root (its attributes, metadata, embedding, lm_head), or None."""
        try:
            self.attrs
            for name in ("embed_tokens", "lm_head"):
                self.embedding(name)
        except StoreCorrupt as e:
            return e.damage
        return None

    def _rebuild(self, attrs: StoreAttrs, embed: torch.Tensor, lm_head: torch.Tensor, damage: str) -> None:
        """Write the root again from this run, whose fingerprint must be the one the damaged root
        still shows (in its commit file or its attributes): the shards were made with these settings."""
        shown = set()
        for read in (lambda: self.read_json(layout.commit_key("root"))["fingerprint"],
                     lambda: json.loads(self.fs.cat_file(self.path("zarr.json")))["attributes"]["fingerprint"]):
            try:
                shown.add(read())
            except Exception:  # noqa: BLE001 - a damaged copy shows nothing
                pass
        if attrs.fingerprint not in shown:
            why = (f"the store was made with other settings (fingerprint {', '.join(f[:12] for f in sorted(shown))}, "
                   f"this run {attrs.fingerprint[:12]})" if shown
                   else "no fingerprint is left to check this run against")
            raise StoreMismatch(f"{self.location}: the root is damaged ({damage}) and cannot be rebuilt from this "
                                f"run: {why}")
        for key in ("target", "zarr.json"):
            if self.fs.exists(self.path(key)):
                self.fs.rm(self.path(key), recursive=True)
        for cached in ("_attrs", "_root_commit"):
            self.__dict__.pop(cached, None)
        self._create(attrs, embed, lm_head, over_shards=True)

    def _create(self, attrs: StoreAttrs, embed: torch.Tensor, lm_head: torch.Tensor, over_shards: bool = False) -> None:
        if not over_shards and self.fs.exists(self.path("shards")) and self.fs.ls(self.path("shards")):
            raise NotAStore(f"{self.location}: has shard data but no root commit; not a store this tool made")
        g = zarr.open_group(self.location, mode="a")
        checksums = {}
        for name, w in (("embed_tokens", embed), ("lm_head", lm_head)):
            bits = layout.to_bits(w.detach().to("cpu", torch.bfloat16))
            rows = max(1, min(bits.shape[0], (1 << 24) // max(1, bits.shape[1] * 2)))
            g.create_array(f"target/{name}", shape=bits.shape, dtype=np.uint16, chunks=(rows, bits.shape[1]),
                           compressors=layout.hidden_codecs(attrs.compat.compression_level),
                           fill_value=0, overwrite=True)[:] = bits
            checksums[name] = layout.crc32(bits)
        g.attrs.put(to_json(attrs))
        folder = self.root.rstrip("/")
        record = RootCommit(time=time.time(), host=HOST, fingerprint=attrs.fingerprint, checksums=checksums,
                            metadata=commit_file.file_checksums(self.fs, folder, list(ROOT_METADATA)))
        self.write_json(layout.commit_key("root"), to_json(record))

    def check_compatible(self, compat: Compat) -> None:
        if self.attrs.schema_version < SCHEMA_VERSION:
            raise StoreMismatch(f"{self.location} is a schema-{self.attrs.schema_version} store (an earlier "
                                f"dflash-pipeline's layout): training and evaluation still read it, but new shards "
                                f"go into a new store (schema {SCHEMA_VERSION})")
        if self.attrs.compat.codec != layout.CODEC:
            raise StoreMismatch(f"{self.location} holds states coded with {self.attrs.compat.codec} (the retired "
                                f"--codec option): training and evaluation still read it, but new shards go into a "
                                f"new store ({layout.CODEC})")
        diff = self.attrs.compat.differences(compat)
        if diff:
            detail = "; ".join(f"{k}: store has {_short(a)}, this run has {_short(b)}" for k, (a, b) in sorted(diff.items()))
            raise StoreMismatch(f"{self.location} was made with a different target/taps/config, refusing to add shards "
                                f"({detail})")

    def embedding(self, name: str) -> torch.Tensor:
        """'embed_tokens' or 'lm_head': [V, H] bf16, checked against the root commit's checksum."""
        key = f"target/{name}"
        try:
            bits = self.group("r")[key][:]
        except KeyError:
            raise StoreCorrupt(f"{self.path(key)}: missing", ROOT_FIX) from None
        except Exception as e:  # noqa: BLE001 - zarr's own error on a chunk or metadata it cannot decode
            raise StoreCorrupt(f"{self.path(key)}: unreadable ({type(e).__name__}: {e})", ROOT_FIX) from None
        expected = self.root_commit.checksums.get(name)
        if expected is not None and layout.crc32(bits) != expected:
            raise StoreCorrupt(f"{self.path(key)}: its CRC-32 is not the one {layout.commit_key('root')} records (a "
                               f"chunk file is damaged, missing or replaced)", ROOT_FIX)
        return layout.from_bits(bits)

    # -- shards ----------------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return self.attrs.num_shards

    def commit_record(self, shard: int) -> ShardCommit | None:
        """Shard's commit record, or None while it is not committed; StoreCorrupt (with what to run)
        when its commit file is damaged."""
        key = layout.commit_key(shard)
        try:
            d = self.read_json(key)
            return None if d is None else ShardCommit.from_json(d, self.path(key))
        except StoreCorrupt as e:
            raise self.shard_damage(e, shard) from None

    def check_shard_files(self, shard: int, record: ShardCommit) -> None:
        """The shard's metadata files against the checksums its commit file records (when it does)."""
        try:
            commit_file.check_files(self.fs, self.path(layout.shard_group(shard)), record.metadata or {})
        except StoreCorrupt as e:
            raise self.shard_damage(e, shard) from None

    def shard_metadata(self, shard: int, arrays: list[str]) -> dict[str, int]:
        """The CRC-32 of the shard's group and array metadata files, for its commit record."""
        names = ["zarr.json", *(f"{a}/zarr.json" for a in arrays)]
        return commit_file.file_checksums(self.fs, self.path(layout.shard_group(shard)), names)

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
        """Shard id -> its commit record, for every committed shard; StoreCorrupt on the first
        damaged commit file."""
        good, damaged = self.commits()
        if damaged:
            raise next(iter(damaged.values()))
        return good

    def commits(self) -> tuple[dict[int, ShardCommit], dict[int, StoreCorrupt]]:
        """(shard -> commit record, shard -> the error of its damaged commit file), in shard order."""
        good, damaged = {}, {}
        try:
            names = self.fs.ls(self.path("_commits"), detail=False)
        except FileNotFoundError:
            return good, damaged
        shards = [int(b[:-5]) for b in (n.rstrip("/").rsplit("/", 1)[-1] for n in names)
                  if b.endswith(".json") and b[:-5].isdigit()]
        paths = [self.path(layout.commit_key(s)) for s in shards]
        for shard, path, data in zip(shards, paths, commit_file.cat_many(self.fs, paths)):  # one batch of reads
            if isinstance(data, FileNotFoundError):
                continue  # removed since the listing
            if isinstance(data, Exception):
                raise data
            try:
                good[shard] = ShardCommit.from_json(commit_file.parse(data, path), path)
            except StoreCorrupt as e:
                damaged[shard] = self.shard_damage(e, shard)
        return dict(sorted(good.items())), dict(sorted(damaged.items()))

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
