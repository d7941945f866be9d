"""A store opened to write, which extraction alone gets: the root created once or checked against
this run's settings (rebuilt under --redo when damaged), shards cleared, written and committed.

Commit files are written last and atomically (a temporary name, then a rename; on object stores a
single put), so a reader or a rerun only trusts what was finished. The root and each shard are
claimed under a lease: a lock file on a POSIX file system (store/io/locks.py), an object on S3
(store/io/object_lease.py, conditional writes), once a probe showed the store honours them: one
that ignores them is refused before any lease is taken (store/io/s3_objects.py). Other object stores
have none: each process must then be given disjoint shard ranges.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch
import zarr

from store.errors import NotAStore, StoreCorrupt, StoreError, StoreMismatch
from store.format import layout
from store.format.schema import SCHEMA_VERSION, Compat, RootCommit, ShardCommit, StoreAttrs, to_json
from store.hidden_store import ROOT_METADATA, HiddenStore
from store.io import commit_file
from store.io.locks import HOST, LEASE_S, LockFile, heartbeat_for
from store.io.object_lease import ObjectLease
from store.io.s3_objects import conditional_objects

ROOT_LOCK_TIMEOUT_S = 3600.0


class StoreWriter(HiddenStore):
    """The read view, plus what writing a store takes. lease_s: how long a claim outlives its holder's
    last heartbeat (a dead node's shards are taken over after it)."""

    def __init__(self, location: str, lease_s: float = LEASE_S) -> None:
        super().__init__(location)
        self.lease_s = lease_s
        self._objects = None if self.local else conditional_objects(self.fs)

    @property
    def leased(self) -> bool:
        """Whether claims are leases here (a POSIX file system, S3), so processes may share shards."""
        return self.local or self._objects is not None

    def check_leases(self) -> None:
        """Where claims are leases on an object store (S3), the store honours the conditional writes
        they are built from, or one line naming what it ignored (a probe of a few requests, once per
        process and store: store/io/s3_objects.py). Nothing to check on a POSIX file system."""
        if self._objects is not None:
            self._objects.check_honoured(self.location, self.path("_locks"))

    # -- files -----------------------------------------------------------------------------
    def write_json(self, key: str, obj: dict) -> None:
        """Write a commit file (sealed, atomically)."""
        commit_file.write(self.fs, self.path(key), obj, self.local)

    def lock(self, name: str) -> LockFile | ObjectLease | None:
        """The lease on the root or a shard (not yet taken); None where the store has no leases."""
        path, beat = self.path(f"_locks/{name}.lock"), heartbeat_for(self.lease_s)
        if self.local:
            return LockFile(Path(path), self.lease_s, beat)
        if self._objects is None:
            return None
        self.check_leases()  # no lease is taken on a store that ignores their conditions (probed once)
        return ObjectLease(self._objects, path, self.lease_s, beat)

    # -- root ------------------------------------------------------------------------------
    def create_or_check(
        self, attrs: StoreAttrs, embed: torch.Tensor, lm_head: torch.Tensor, repair: bool = False
    ) -> str:
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
                    self._rebuild(attrs, embed, lm_head, damage, lock)
                    return "rebuilt"
                self.check_compatible(attrs.compat)
                return "opened"
            self._create(attrs, embed, lm_head, lock)
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

    def _rebuild(
        self,
        attrs: StoreAttrs,
        embed: torch.Tensor,
        lm_head: torch.Tensor,
        damage: str,
        lock: LockFile | ObjectLease | None,
    ) -> None:
        """Write the root again from this run, whose fingerprint must be the one the damaged root
        still shows (in its commit file or its attributes): the shards were made with these settings."""
        shown = set()
        for read in (
            lambda: self.read_json(layout.commit_key("root"))["fingerprint"],
            lambda: json.loads(self.fs.cat_file(self.path("zarr.json")))["attributes"]["fingerprint"],
        ):
            try:
                shown.add(read())
            except Exception:  # noqa: BLE001 - a damaged copy shows nothing
                pass
        if attrs.fingerprint not in shown:
            why = (
                f"the store was made with other settings (fingerprint {', '.join(f[:12] for f in sorted(shown))}, "
                f"this run {attrs.fingerprint[:12]})"
                if shown
                else "no fingerprint is left to check this run against"
            )
            raise StoreMismatch(
                f"{self.location}: the root is damaged ({damage}) and cannot be rebuilt from this run: {why}"
            )
        for key in ("target", "zarr.json"):
            if self.fs.exists(self.path(key)):
                self.fs.rm(self.path(key), recursive=True)
        for cached in ("_attrs", "_root_commit"):
            self.__dict__.pop(cached, None)
        self._create(attrs, embed, lm_head, lock, over_shards=True)

    def _create(
        self,
        attrs: StoreAttrs,
        embed: torch.Tensor,
        lm_head: torch.Tensor,
        lock: LockFile | ObjectLease | None,
        over_shards: bool = False,
    ) -> None:
        if not over_shards and self.fs.exists(self.path("shards")) and self.fs.ls(self.path("shards")):
            raise NotAStore(f"{self.location}: has shard data but no root commit; not a store this tool made")
        g = zarr.open_group(self.location, mode="a")
        checksums = {}
        for name, w in (("embed_tokens", embed), ("lm_head", lm_head)):
            bits = layout.to_bits(w.detach().to("cpu", torch.bfloat16))
            rows = max(1, min(bits.shape[0], (1 << 24) // max(1, bits.shape[1] * 2)))
            g.create_array(
                f"target/{name}",
                shape=bits.shape,
                dtype=np.uint16,
                chunks=(rows, bits.shape[1]),
                compressors=layout.hidden_codecs(attrs.compat.compression_level),
                fill_value=0,
                overwrite=True,
                chunk_key_encoding=layout.chunk_key_encoding(),
            )[:] = bits
            checksums[name] = layout.crc32(bits)
        g.attrs.put(to_json(attrs))
        folder = self.root.rstrip("/")
        record = RootCommit(
            time=time.time(),
            host=HOST,
            fingerprint=attrs.fingerprint,
            checksums=checksums,
            metadata=commit_file.file_checksums(self.fs, folder, list(ROOT_METADATA)),
        )
        if lock is not None and not lock.still_held():
            raise StoreError(
                f"{self.location}: lost the lock on the root ({lock.path}) while creating it; "
                "not committing it (rerun: the process that took it over creates it)"
            )
        self.write_json(layout.commit_key("root"), to_json(record))

    def check_compatible(self, compat: Compat) -> None:
        shape = self.layout
        if shape.schema < SCHEMA_VERSION:
            raise StoreMismatch(
                f"{self.location} is a schema-{shape.schema} store (an earlier "
                f"dflash-pipeline's layout): training and evaluation still read it, but new shards "
                f"go into a new store (schema {SCHEMA_VERSION})"
            )
        if not shape.writable:
            raise StoreMismatch(
                f"{self.location} holds states coded with {shape.codec} (the retired "
                f"--codec option): training and evaluation still read it, but new shards go into a "
                f"new store ({shape.format.codec})"
            )
        diff = self.attrs.compat.differences(as_recorded(self.attrs.compat, compat))
        if diff:
            detail = "; ".join(
                f"{k}: store has {_short(a)}, this run has {_short(b)}" for k, (a, b) in sorted(diff.items())
            )
            hint = (
                f"; its states are {shape.format.name}: pass --hidden-format {shape.format.name}"
                if "hidden_format" in diff
                else ""
            )
            if "shard_tokens" in diff:  # the default grew from 4096 to 16384 with format revision 5
                hint += f"; pass --shard-tokens {self.attrs.compat.shard_tokens}, the store's"
            if "conv1d" in diff:
                hint += conv1d_hint(self.attrs.compat.conv1d)
            raise StoreMismatch(
                f"{self.location} was made with a different target/taps/config, refusing to add shards ({detail}){hint}"
            )

    # -- shards ----------------------------------------------------------------------------
    def shard_metadata(self, shard: int, arrays: list[str]) -> dict[str, int]:
        """The CRC-32 of the shard's group and array metadata files, for its commit record."""
        names = ["zarr.json", *(f"{a}/zarr.json" for a in arrays)]
        return commit_file.file_checksums(self.fs, self.path(layout.shard_group(shard)), names)

    def write_commit(self, record: ShardCommit) -> None:
        """Commit a shard: its record, written last and atomically."""
        self.write_json(layout.commit_key(record.shard), record.to_json())

    def clear_shard(self, shard: int) -> None:
        """Remove a shard's arrays and commit file (a rerun redoes it from scratch)."""
        for key in (layout.commit_key(shard), layout.shard_group(shard)):
            if self.fs.exists(self.path(key)):
                self.fs.rm(self.path(key), recursive=True)

    def write_pieces(self, key: str, pieces: list) -> None:
        """Write a file made of byte pieces, in order (no joined copy)."""
        path = self.path(key)
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        with self.fs.open(path, "wb") as fh:
            for piece in pieces:
                fh.write(piece)


def as_recorded(stored: Compat, run: Compat) -> Compat:
    """The run's settings as the store records them: a store made before the conv1d kernel was
    recorded (compat.conv1d absent) takes shards of either kernel, as it always did; each shard's
    commit file names the kernel that made it (run.backends)."""
    return run if stored.conv1d is not None else dataclasses.replace(run, conv1d=None)


def conv1d_hint(stored: str) -> str:
    """What to do when this run's conv1d kernel (compat.conv1d) is not the store's."""
    return (
        f"; its states were made with the {stored} conv1d kernel: add shards from a node that runs it "
        "(causal_conv1d: the causal-conv1d package, on CUDA)"
    )


def _short(v) -> str:
    text = json.dumps(v, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
