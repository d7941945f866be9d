"""A store opened to read: its root attributes and embedding, shard commits, readers' checks, sizes.

A local path or any fsspec URL zarr accepts. Train, evaluate, export, `pipeline info` and `verify`
get this view; extraction alone gets the writer (store/store_writer.py), as zarr opens a group
'r' or 'w-'. Commit files are written last and atomically, so a reader only trusts what was
finished; they are sealed by their own checksum and record the checksums of the metadata files
zarr parses, which are checked before zarr reads them (store/io/commit_file.py). What else a read
checks depends on the store's layout (store/format/read_checks.py).
"""

from __future__ import annotations

import functools
import os
import time
from typing import TYPE_CHECKING

import fsspec
import fsspec.config
import zarr
from fsspec.implementations.local import LocalFileSystem
from zarr.core.group import GroupMetadata
from zarr.core.sync import sync
from zarr.storage import StorePath
from zarr.storage._common import make_store_path

from store.errors import ROOT_FIX, ConfigError, NotAStore, NotCommitted, StoreCorrupt, redo_hint
from store.format import layout
from store.format.ranges import format_ranges
from store.format.read_checks import Layout, ReadChecks, layout_of, read_checks
from store.format.schema import RootCommit, ShardCommit, StoreAttrs
from store.io import commit_file, object_store, read_cache, zarr_files
from store.io.node_cache import NodeCache

S3_CONNECTIONS = 64  # requests in flight at once per S3 file system: a batch of reads, several threads' readers

# the root's metadata files, which its commit file records the CRC-32 of (fetched with it)
ROOT_METADATA = ("zarr.json", "target/zarr.json", "target/embed_tokens/zarr.json", "target/lm_head/zarr.json")

if TYPE_CHECKING:
    import torch  # the view itself needs no torch; embedding() returns a tensor (store/format/layout.from_bits)


class HiddenStore:
    def __init__(
        self, location: str, cache_bytes: int = read_cache.DEFAULT_BYTES, node_cache: NodeCache | None = None
    ) -> None:
        """cache_bytes: the bound of what this handle's readers keep of what they fetched beyond
        the spans asked for (store/io/read_cache.py; 0: nothing kept). node_cache: a node-local
        directory the shard files of an object store are read through, each fetched once per node
        (store/io/node_cache.py); a local store ignores it (its files are on a disk already)."""
        self.location = str(location)
        self.cache = read_cache.ReadCache(cache_bytes)
        self.fs, self.root = object_store.file_system(self.location, **_connections(self.location))
        self.local = isinstance(self.fs, LocalFileSystem)
        if self.local:
            _refuse_a_file(self.location, self.root)
        self.node = None if node_cache is None or self.local else node_cache.view(self.location, self.root)

    def check_reachable(self) -> None:
        """An object store's bucket exists and answers (one request), or one line saying what is wrong
        (store/io/object_store.py); a local store: nothing to check. Commands call it as they start."""
        if not self.local:
            object_store.reachable(self.location, self.fs, self.root)

    # -- files -----------------------------------------------------------------------------
    def path(self, key: str) -> str:
        """The file system path of a key in the store."""
        return f"{self.root.rstrip('/')}/{key}"

    def node_files(self, shard: int, record: ShardCommit):
        """The node-local cache (store/io/node_cache.StoreFiles) shard's readers fetch through, at the
        commit `record`; None when there is none (no cache, or a local store)."""
        if self.node is not None:
            self.node.admit(layout.shard_group(shard), record)
        return self.node

    def fetch(self, keys: list[str]) -> dict:
        """key -> the bytes of each file, or the exception its fetch raised (FileNotFoundError: none),
        fetched in one batch (on an object store: concurrent GETs, no HEAD first)."""
        return dict(zip(keys, commit_file.cat_many(self.fs, [self.path(k) for k in keys])))

    @functools.cached_property
    def store_path(self) -> StorePath:
        """zarr's handle on the store, for arrays opened over metadata already read (store/io/zarr_files.py)."""
        return sync(make_store_path(self.location, mode="r"))

    def read_json(self, key: str) -> dict | None:
        """A commit file's record; None when it does not exist, StoreCorrupt when it is damaged."""
        return commit_file.read(self.fs, self.path(key))

    def exists(self) -> bool:
        return self.fs.exists(self.path(layout.commit_key("root")))

    def read_checks(self, records: dict[int, ShardCommit] | None = None) -> ReadChecks:
        """What reading this store checks (store/format/read_checks.py); records: the commit records of the
        shards asked about (default: every committed one)."""
        return read_checks(self.location, self.layout, self.commits()[0] if records is None else records)

    @property
    def layout(self) -> Layout:
        """The store's layout (store/format/read_checks.py), read from its root."""
        return layout_of(self.attrs, self.root_commit)

    def require_final_state(self, flag: str, value, needs: str) -> None:
        """ConfigError naming flag=value unless the store keeps the target's final states; needs: what the
        flag takes from them."""
        if not self.layout.final_state:
            raise ConfigError(
                flag,
                value,
                f"{self.location} holds no final states ({needs} comes from them); "
                "extract the store with `pipeline extract --final-state`",
            )

    def shard_damage(self, e: StoreCorrupt, shard: int, sample: int | None = None) -> StoreCorrupt:
        """e, told which shard (and sample) it lies in and what to run about it."""
        return e.located(
            f"shard {shard}" + ("" if sample is None else f", sample {sample}"), redo_hint(self.location, shard)
        )

    # -- root ------------------------------------------------------------------------------
    def group(self) -> zarr.Group:
        return zarr.open_group(self.location, mode="r")

    @property
    def root_commit(self) -> RootCommit:
        """The root's commit record (read once, in one batch with the metadata files it vouches for)."""
        if not hasattr(self, "_root_commit"):
            key = layout.commit_key("root")
            with object_store.failures(self.location, self.fs):  # the first request of most readers
                got = self.fetch([key, *ROOT_METADATA])
            data = got.pop(key)
            if isinstance(data, FileNotFoundError):
                raise NotAStore(f"{self.location}: not a hidden-state store (no {key})")
            if isinstance(data, Exception):
                raise data
            try:
                self._root_commit = RootCommit.from_json(commit_file.parse(data, self.path(key)), self.path(key))
            except StoreCorrupt as e:
                raise e.located(None, ROOT_FIX) from None
            self._root_files = got  # fetched with the record they are checked against
        return self._root_commit

    def _root_files_for(self, names: list[str]) -> dict:
        """name -> bytes (or the exception its fetch raised) of root files, those not fetched with
        the root commit fetched now (one batch); not yet checked."""
        self.root_commit
        missing = [n for n in names if n not in self._root_files]
        if missing:
            self._root_files.update(self.fetch(missing))
        return {n: self._root_files[n] for n in names}

    @property
    def attrs(self) -> StoreAttrs:
        """The root attributes (read once, checked on the way in: the root's metadata files against
        the checksums its commit file records, the fingerprint against the one it repeats)."""
        if not hasattr(self, "_attrs"):
            root = self.root_commit
            recorded = root.metadata or {}
            try:
                files = self._root_files_for(sorted({*recorded, "zarr.json"}))
                commit_file.check_fetched(self.root.rstrip("/"), recorded, files)
                raw = dict(zarr_files.parse(files["zarr.json"], self.path("zarr.json"), GroupMetadata).attributes)
            except StoreCorrupt as e:
                raise e.located(None, ROOT_FIX) from None
            attrs = StoreAttrs.from_json(raw, self.location)
            if attrs.fingerprint != root.fingerprint:
                raise StoreCorrupt(
                    f"{self.path('zarr.json')}: the attributes' fingerprint {attrs.fingerprint[:12]} is "
                    f"not the {root.fingerprint[:12]} of {layout.commit_key('root')}",
                    ROOT_FIX,
                )
            self._attrs = attrs
        return self._attrs

    def embedding(self, name: str) -> torch.Tensor:
        """'embed_tokens' or 'lm_head': [V, H] bf16, checked against the root commit's checksum."""
        return self.embeddings((name,))[0]

    def embeddings(self, names: tuple[str, ...] = ("embed_tokens", "lm_head")) -> list[torch.Tensor]:
        """Each of names ('embed_tokens', 'lm_head'): [V, H] bf16, their chunks fetched together
        (store/io/zarr_files.py: one batch of requests up to a GB), each checked against the root
        commit's checksum, its metadata against the CRC-32 the root commit records."""
        root = self.root_commit
        arrays = []
        for name in names:
            key = f"target/{name}"
            meta = f"{key}/zarr.json"
            data = self._root_files_for([meta])[meta]
            if isinstance(data, FileNotFoundError):
                raise StoreCorrupt(f"{self.path(key)}: missing", ROOT_FIX)
            try:
                commit_file.check_fetched(
                    self.root.rstrip("/"), {k: v for k, v in (root.metadata or {}).items() if k == meta}, {meta: data}
                )
                arrays.append((self.path(key), zarr_files.parse(data, self.path(meta))))
            except StoreCorrupt as e:
                raise e.located(None, ROOT_FIX) from None
        out = []
        for name, (path, _), bits in zip(names, arrays, zarr_files.read_whole(self.fs, arrays)):
            if isinstance(bits, Exception):  # a fetch that failed, zarr's own error on a chunk it cannot decode
                raise StoreCorrupt(f"{path}: unreadable ({type(bits).__name__}: {bits})", ROOT_FIX)
            expected = root.checksums.get(name)
            if expected is not None and layout.crc32(bits) != expected:
                raise StoreCorrupt(
                    f"{path}: its CRC-32 is not the one {layout.commit_key('root')} records (a chunk "
                    f"file is damaged, missing or replaced)",
                    ROOT_FIX,
                )
            out.append(layout.from_bits(bits))
        return out

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

    def check_shard_files(self, shard: int, record: ShardCommit, got: dict | None = None) -> None:
        """The shard's metadata files against the checksums its commit file records (when it does).
        got: the files already fetched (key under the shard's group -> bytes or exception), else
        fetched here (in one batch)."""
        folder, recorded = self.path(layout.shard_group(shard)), record.metadata or {}
        try:
            if got is None:
                commit_file.check_files(self.fs, folder, recorded)
            else:
                commit_file.check_fetched(folder, recorded, got)
        except StoreCorrupt as e:
            raise self.shard_damage(e, shard) from None

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

    def commit_ids(self, fresh: bool = False) -> list[int]:
        """The shards with a commit file, from one listing of `_commits/`; fresh: listed again, not
        from a listing this process cached earlier (a store that is still being extracted)."""
        folder = self.path("_commits")
        if fresh:
            self.fs.invalidate_cache(folder)
        try:
            names = self.fs.ls(folder, detail=False)
        except FileNotFoundError:
            return []
        return [
            int(b[:-5])
            for b in (n.rstrip("/").rsplit("/", 1)[-1] for n in names)
            if b.endswith(".json") and b[:-5].isdigit()
        ]

    def commits(self, shards: list[int] | None = None) -> tuple[dict[int, ShardCommit], dict[int, StoreCorrupt]]:
        """(shard -> commit record, shard -> the error of its damaged commit file), in shard order, of
        every committed shard, or of those of `shards` committed; their commit files in one batch of reads."""
        good, damaged = {}, {}
        shards = self.commit_ids() if shards is None else shards
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

    def shard_arrays(self, shard: int) -> zarr.Group:
        return zarr.open_group(self.location, mode="r", path=layout.shard_group(shard))

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
                return {f[len(path) + 1 :]: int(n) for f, n in self.fs.du(path, total=False).items()}
            except FileNotFoundError:
                if attempt == 4:
                    raise
                time.sleep(0.1)


def _connections(location: str) -> dict:
    """Storage options for location: on S3, a connection pool of S3_CONNECTIONS unless the user's
    fsspec configuration sets one (botocore's default of 10 queues an opening's dozen requests, and
    the readers of several threads, behind each other)."""
    protocol = fsspec.core.split_protocol(location)[0]
    if protocol not in ("s3", "s3a"):
        return {}
    configured = fsspec.config.conf.get(protocol, {}).get("config_kwargs", {})
    return {"config_kwargs": {"max_pool_connections": S3_CONNECTIONS, **configured}}


def _refuse_a_file(location: str, root: str) -> None:
    """A local store is a directory: NotAStore when its path, or the nearest existing path above it,
    is a file (zarr would fail on it deep down, with no word about the store)."""
    p = os.path.abspath(root)
    while not os.path.lexists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    if os.path.isdir(p):
        return
    what = (
        "a file, not a hidden-state store" if p == os.path.abspath(root) else f"not a hidden-state store: {p} is a file"
    )
    raise NotAStore(
        f"{location}: {what} (a store is a directory, as `pipeline extract` writes it); give the store's directory"
    )


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
