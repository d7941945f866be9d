"""A node-local cache of an object store's shard files: each file fetched whole once per node, then
read from the node's own disk (a node that reads only its share of the shards keeps that
share here, so each byte crosses the network about once per run).

    CACHE/
      bound.json                   the bound: bytes the directory may hold (recorded once, see below)
      index.sqlite                 file -> bytes, last used; the total
      .tmp/                        files being written (renamed into place when whole)
      .filling/                    fill locks: one marker per file a process is fetching
      <store>/shards/00003/<commit>/hidden/c.0.0.0   a copy of STORE/shards/00003/hidden/c.0.0.0

<store> is a short hash of the store's location, <commit> one of the shard's commit record: a shard
re-extracted with --redo gets new files under the same names and a new record, so it is never
served from the old copies (those age out). Only shard files are cached (the store's root files,
commit records and embedding are read once a run anyway).

The granularity is one store file (a zarr shard file of the states, a chunk or metadata file of the
small arrays), fetched with one GET, written under .tmp/ and renamed into place: a file in the cache
is whole (what it holds is still checked by every read: the crc32c of each chunk, the checksums of
the commit record). Ranges of a cached file are read as a local store reads them
(store/io/byte_fetch.py); a copy that fails its check is dropped and read once more from the object
store by the caller (store/span_reader.py), so a local disk fault is never reported as a damaged
store.

Shared by every process of the node (ranks and their loader workers), safe under concurrency:
  - the index is an sqlite database (WAL, busy timeout); a file is renamed into place, its row
    written and least-recently-used files evicted (file deleted, then its row) in one write
    transaction, so no process renames a file that another's eviction is deleting;
  - a process updates a file's last use at most once a minute (no write per read);
  - a file evicted under a process about to read it is simply missing: fetched again, never an error;
  - a cache that cannot be written (its disk full, its index unwritable, the directory not
    makeable) is not an error: the file that could not be kept is read from memory, and the process
    reads on from the object store without the cache; `trouble` says why (the first reason), and
    `warn`, when given, is told once (callers say it in one line);
  - nothing is made on disk until the first file is fetched: a run that reads no object-store file
    (a local store, a run that fails first) leaves no directory;
  - two processes missing one file: the first takes a fill lock (an O_EXCL marker), the other
    waits for the file to appear (up to FILL_WAIT_S, or until the marker goes) and fetches it
    itself only then; a marker older than FILL_WAIT_S is a dead process's and is taken over (so a
    process killed while fetching stalls the others' reads of that file by up to FILL_WAIT_S, once).
A file whose row was lost (a process killed between rename and commit) is counted again on its
next use. The bound counts file bytes, not the file system's blocks.

The bound belongs to the directory, not to a process: the first process that writes in it records
its `max_bytes` in bound.json (written whole, then linked into place: a second writer finds it there
and never replaces it), and every process after evicts to the recorded bound, whatever it was given.
So an evaluation started with a smaller size on a node whose training shares the cache cannot evict
the training's files below the training's bound. A process given another size is told in one line
(`overruled`); to change the bound, delete bound.json while no process uses the directory: the next
one records its own. A bound.json that does not read as a record is an error naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sqlite3
import threading
import time
import uuid

from fsspec.implementations.local import LocalFileSystem

from store.errors import ConfigError
from store.io.byte_fetch import Range
from store.io.byte_fetch import fetch as fetch_ranges

TOUCH_EVERY_S = 60.0  # a process writes a file's last use at most this often
FILL_WAIT_S = 60.0  # how long a process waits for a file another is fetching (and when a marker is stale)
_POLL_S = 0.02
_INDEX = "index.sqlite"
BOUND = "bound.json"  # the directory's bound, recorded by the first process that writes in it
UNWRITABLE = (OSError, sqlite3.DatabaseError)  # what a cache that cannot be written raises (disk full, I/O error)
_DISK = LocalFileSystem()


def short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def commit_identity(record) -> str:
    """A short hash of a shard's commit record (store/format/schema.ShardCommit): changes with every commit."""
    return short_hash(json.dumps(record.to_json(), sort_keys=True))


def recorded_bound(root: str) -> int | None:
    """The bound (bytes) a cache directory records, or None where it records none (a new directory).
    A record that does not read as one: ConfigError naming the file, the field and what was expected."""
    path = os.path.join(os.path.abspath(root), BOUND)
    try:
        with open(path, "rb") as f:
            text = f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    value = record.get("max_bytes") if isinstance(record, dict) else None
    if type(value) is not int or value <= 0:
        got = "no JSON object" if not isinstance(record, dict) else f"max_bytes {value!r}"
        raise ConfigError(
            "--cache-dir",
            os.path.abspath(root),
            f"{path} holds {got}, expected the directory's bound as a positive number of bytes "
            "(max_bytes); delete that file while no process uses the directory: the next run records "
            "its --cache-size there",
        )
    return value


class NodeCache:
    """A bounded directory of whole store files on this node, shared by its processes (see the module)."""

    def __init__(self, root: str, max_bytes: int, warn=None) -> None:
        """max_bytes: this process's bound, recorded as the directory's when it records none yet; the
        recorded one applies otherwise (see the module). warn: called once with a line saying why, when
        the cache cannot be written, or when another process recorded another bound first."""
        assert max_bytes > 0
        self.root, self.warn = os.path.abspath(root), warn
        self.asked = int(max_bytes)  # this process's own bound
        recorded = recorded_bound(self.root)
        self.max_bytes = self.asked if recorded is None else recorded  # the bound this process evicts to
        self._bound_read = recorded is not None  # False: recorded (or read) when the directory is first written
        self.trouble: str | None = None  # why this process reads without the cache (None: it uses it)
        self._local = threading.local()  # one sqlite connection per thread and process
        self._touched: dict[str, float] = {}
        self._pid = os.getpid()

    def __getstate__(self) -> dict:  # sent to loader workers: each opens its own connections
        return {"root": self.root, "max_bytes": self.max_bytes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["root"], state["max_bytes"])

    def overruled(self) -> str | None:
        """A line saying this process's bound was not applied, the directory recording another one; None
        when they agree."""
        if self.asked == self.max_bytes:
            return None
        return (
            f"--cache-size {_size(self.asked)} not applied: --cache-dir {self.root} keeps the bound "
            f"recorded in it, {_size(self.max_bytes)} ({BOUND}, written by the first process that used the "
            "directory), and this process evicts only beyond that; to change the bound, delete "
            f"{os.path.join(self.root, BOUND)} while no process uses the directory (the next run records "
            "its --cache-size), or leave --cache-size out"
        )

    def ready(self) -> bool:
        """Make the directory and the index when this process first needs them: False (and `trouble`
        set) when the cache cannot be written."""
        if self.trouble is None and getattr(self._local, "db", None) is None:
            try:
                with self._db() as db:
                    db.execute(
                        "CREATE TABLE IF NOT EXISTS files (key TEXT PRIMARY KEY, bytes INTEGER NOT NULL, "
                        "last_used REAL NOT NULL)"
                    )
                    db.execute("CREATE INDEX IF NOT EXISTS by_use ON files (last_used)")
                    db.execute(
                        "CREATE TABLE IF NOT EXISTS total (id INTEGER PRIMARY KEY CHECK (id = 0), bytes INTEGER)"
                    )
                    db.execute("INSERT OR IGNORE INTO total VALUES (0, 0)")
                if not self._bound_read:
                    self._record_bound()
            except UNWRITABLE as e:
                self._give_up(e)
        return self.trouble is None

    def _record_bound(self) -> None:
        """Record this process's bound as the directory's, unless a process recorded one first: then
        that one applies here too (said through warn when it is not this process's)."""
        path, temp = os.path.join(self.root, BOUND), os.path.join(self.root, ".tmp", f"{uuid.uuid4().hex}.json")
        record = {"max_bytes": self.max_bytes, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
        try:
            with open(temp, "w") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())  # once per directory: a crash of the node leaves no empty record
            try:
                os.link(temp, path)  # never replaces: of processes arriving together, the first one's stays
            except FileExistsError:
                pass
            except OSError:  # a file system without hard links: a rename, unless one is there by now
                if not os.path.exists(path):
                    os.replace(temp, path)
        finally:
            _unlink(temp)
        recorded = recorded_bound(self.root)  # this process's, or the one recorded first
        self.max_bytes, self._bound_read = self.max_bytes if recorded is None else recorded, True
        if self.max_bytes != self.asked and self.warn is not None:
            self.warn(self.overruled())

    def _give_up(self, e: Exception) -> None:
        """The cache cannot be written: this process reads on without it; said once."""
        if self.trouble is None:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            self.trouble = (
                f"--cache-dir {self.root} cannot be written ({reason}): reading on from the object "
                "store without the node cache, nothing lost but its speed; free space there or point "
                "--cache-dir at another disk"
            )
            if self.warn is not None:
                self.warn(self.trouble)

    # -- keys ------------------------------------------------------------------------------
    def folder(self, location: str, group: str, record) -> str:
        """Where the files of a shard (its group, e.g. 'shards/00003', at this commit) are kept."""
        return os.path.join(self.root, short_hash(location), group, commit_identity(record))

    def view(self, location: str, store_root: str) -> StoreFiles:
        """This cache as one store's readers use it (store_root: the store's path on its file system)."""
        return StoreFiles(self, location, store_root.rstrip("/"))

    # -- reads -----------------------------------------------------------------------------
    def fetch(self, fs, ranges: list[Range], local_of) -> list:
        """byte_fetch.fetch for the ranges of object-store file system `fs`: the files local_of maps to
        a cache path served from there, fetched whole first when not there; the others fetched as
        ranges. In place of a range that cannot be read, its exception (FileNotFoundError: no such file).
        A cache that cannot be written: every range fetched from the object store."""
        if not self.ready():
            return _ranges(fs, ranges)
        out: list = [None] * len(ranges)
        cached = {i: local_of(r[0]) for i, r in enumerate(ranges)}
        direct = [i for i, p in cached.items() if p is None]
        misses = {}  # cache path -> remote path
        for i, p in cached.items():
            if p is not None and p not in misses and not os.path.exists(p):
                misses[p] = ranges[i][0]
        whole = self._fill(fs, misses, [ranges[i] for i in direct])
        for i, data in zip(direct, whole.pop(None, [])):
            out[i] = data
        hits = [i for i, p in cached.items() if p is not None and p not in whole]
        for i, p in cached.items():
            if p is not None and p in whole:
                out[i] = _cut(whole[p], ranges[i])
        got = fetch_ranges(_DISK, True, [(cached[i], ranges[i][1], ranges[i][2]) for i in hits])
        gone = []
        for i, data in zip(hits, got):
            if isinstance(data, FileNotFoundError):
                gone.append(i)  # evicted since it was seen: read from the store
            else:
                out[i] = data
        if gone:
            for i, data in zip(gone, _ranges(fs, [ranges[i] for i in gone])):
                out[i] = data
        self._touch([cached[i] for i in hits if i not in gone])
        return out

    def drop(self, paths: list[str]) -> None:
        """Forget these cached files (a copy that failed its check): deleted with their rows."""
        keys = [self._key(p) for p in paths]
        if not self.ready():
            return
        try:
            with self._db() as db:
                db.execute("BEGIN IMMEDIATE")
                for p, key in zip(paths, keys):
                    _unlink(p)
                    self._forget(db, key)
        except UNWRITABLE as e:
            self._give_up(e)
        for key in keys:
            self._touched.pop(key, None)

    # -- filling ---------------------------------------------------------------------------
    def _fill(self, fs, misses: dict[str, str], direct: list[Range]) -> dict:
        """Fetch the missed files whole (those another process is fetching: waited for) and put them
        in the cache, and the direct ranges, all in one batch of requests. cache path -> the file's
        bytes (or its exception), and None -> the direct ranges' results."""
        mine, theirs = [], []
        for p in misses:
            (mine if self._claim(p) else theirs).append(p)
        try:
            got = _ranges(fs, [(misses[p], 0, None) for p in mine] + direct)
            whole = dict(zip(mine, got[: len(mine)]))
            self._put({p: d for p, d in whole.items() if isinstance(d, bytes)})
        finally:
            for p in mine:
                _unlink(_marker(self.root, p))
        late = [p for p in self._wait(theirs) if not os.path.exists(p)]
        if late:  # its fetcher gave up or died: fetch it here
            got2 = _ranges(fs, [(misses[p], 0, None) for p in late])
            whole.update(zip(late, got2))
            self._put({p: d for p, d in zip(late, got2) if isinstance(d, bytes)})
        whole[None] = got[len(mine) :]
        return whole

    def _claim(self, path: str) -> bool:
        """Take the fill lock of a cached file (False: another process holds it, and is alive). No room
        even for the marker: the cache gives up, and the file is fetched here (not kept)."""
        marker = _marker(self.root, path)
        for _ in range(2):
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                return True
            except FileExistsError:
                pass
            except OSError as e:
                self._give_up(e)
                return True
            try:
                if time.time() - os.stat(marker).st_mtime < FILL_WAIT_S:
                    return False
                os.unlink(marker)  # a dead fetcher's: take it over
            except FileNotFoundError:
                pass
        return False

    def _wait(self, paths: list[str]) -> list[str]:
        """Wait until each file is in place or its fill lock is gone (at most FILL_WAIT_S)."""
        deadline = time.monotonic() + FILL_WAIT_S
        pending = list(paths)
        while pending and time.monotonic() < deadline:
            pending = [p for p in pending if not os.path.exists(p) and os.path.exists(_marker(self.root, p))]
            if pending:
                time.sleep(_POLL_S)
        return paths

    def _put(self, files: dict[str, bytes]) -> None:
        """Write each file whole under .tmp/, then, in one write transaction, rename it into place,
        record it and evict the least recently used files beyond the bound. What cannot be written
        (the disk full, the index unwritable) is not kept: the caller has the bytes, and the cache
        gives up for this process."""
        if not files or self.trouble is not None:
            return
        temps = {}
        try:
            for p, data in files.items():
                temps[p] = os.path.join(self.root, ".tmp", f"{uuid.uuid4().hex}")
                with open(temps[p], "wb") as f:
                    f.write(data)
            self._publish(temps, {p: len(d) for p, d in files.items()})
        except UNWRITABLE as e:
            for temp in temps.values():
                _unlink(temp)
            self._give_up(e)

    def _publish(self, temps: dict[str, str], sizes: dict[str, int]) -> None:
        now = time.time()
        with self._db() as db:
            db.execute("BEGIN IMMEDIATE")
            for p, temp in temps.items():
                os.makedirs(os.path.dirname(p), exist_ok=True)
                os.replace(temp, p)
                self._record(db, self._key(p), sizes[p], now)
            self._evict(db)
        for p in temps:
            self._touched[self._key(p)] = now

    def _touch(self, paths: list[str]) -> None:
        """Record the use of cached files, each at most once a minute per process; a file with no
        row (its process died before recording it) is recorded now."""
        now = time.time()
        due = [p for p in dict.fromkeys(paths) if now - self._touched.get(self._key(p), 0.0) >= TOUCH_EVERY_S]
        if due:
            try:
                self._record_use(due, now)
            except UNWRITABLE as e:
                self._give_up(e)

    def _record_use(self, due: list[str], now: float) -> None:
        with self._db() as db:
            db.execute("BEGIN IMMEDIATE")
            adopted = False
            for p in due:
                key = self._key(p)
                if db.execute("UPDATE files SET last_used = ? WHERE key = ?", (now, key)).rowcount == 0:
                    try:
                        self._record(db, key, os.stat(p).st_size, now)
                        adopted = True
                    except FileNotFoundError:
                        continue
                self._touched[key] = now
            if adopted:
                self._evict(db)

    # -- index -----------------------------------------------------------------------------
    def _db(self) -> sqlite3.Connection:
        """This thread's connection (autocommit off: transactions are explicit; `with` commits)."""
        if self._pid != os.getpid():  # a forked child: its parent's connections are not its own
            self._local, self._touched, self._pid = threading.local(), {}, os.getpid()
        db = getattr(self._local, "db", None)
        if db is None:
            for folder in (".tmp", ".filling"):
                os.makedirs(os.path.join(self.root, folder), exist_ok=True)
            db = sqlite3.connect(os.path.join(self.root, _INDEX), timeout=60, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            self._local.db = db
        return _Transaction(db)

    def _key(self, path: str) -> str:
        return os.path.relpath(path, self.root)

    def _record(self, db, key: str, nbytes: int, now: float) -> None:
        old = db.execute("SELECT bytes FROM files WHERE key = ?", (key,)).fetchone()
        db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?)", (key, nbytes, now))
        db.execute("UPDATE total SET bytes = bytes + ?", (nbytes - (old[0] if old else 0),))

    def _forget(self, db, key: str) -> None:
        old = db.execute("SELECT bytes FROM files WHERE key = ?", (key,)).fetchone()
        if old:
            db.execute("DELETE FROM files WHERE key = ?", (key,))
            db.execute("UPDATE total SET bytes = bytes - ?", (old[0],))

    def _evict(self, db) -> None:
        """Least recently used files deleted (file, then row) until the total is within the bound."""
        total = db.execute("SELECT bytes FROM total").fetchone()[0]
        while total > self.max_bytes:
            oldest = db.execute("SELECT key, bytes FROM files ORDER BY last_used LIMIT 64").fetchall()
            if not oldest:
                break
            for key, nbytes in oldest:
                _unlink(os.path.join(self.root, key))
                db.execute("DELETE FROM files WHERE key = ?", (key,))
                total -= nbytes
                if total <= self.max_bytes:
                    break
            db.execute("UPDATE total SET bytes = ?", (total,))

    def usage(self) -> tuple[int, int]:
        """(files, bytes) the index holds."""
        with self._db() as db:
            n = db.execute("SELECT COUNT(*) FROM files").fetchone()[0]
            return n, db.execute("SELECT bytes FROM total").fetchone()[0]


class StoreFiles:
    """The cache as one store's readers use it: which remote files map to which cached copies. A
    shard's files are cached once its reader admits it with its commit record (store/shard_reader.py);
    other files are read from the store."""

    def __init__(self, cache: NodeCache, location: str, store_root: str) -> None:
        self.cache, self.location, self.store_root = cache, location, store_root
        self._folders: dict[str, str] = {}  # shard group -> its cache folder at the commit admitted last

    def admit(self, group: str, record) -> None:
        self._folders[group] = self.cache.folder(self.location, group, record)

    def local(self, path: str) -> str | None:
        """The cache path of a store file, or None when it is not cached (not a shard's, or its shard not admitted)."""
        if not path.startswith(self.store_root + "/"):
            return None
        parts = path[len(self.store_root) + 1 :].split("/")
        folder = self._folders.get("/".join(parts[:2]))
        return None if folder is None or len(parts) < 3 else os.path.join(folder, *parts[2:])

    def fetch(self, fs, ranges: list[Range]) -> list:
        return self.cache.fetch(fs, ranges, self.local)

    def drop(self, paths: list[str]) -> None:
        """Drop the cached copies of these store files (those cached)."""
        self.cache.drop([p for p in map(self.local, paths) if p is not None])


class _Transaction:
    """`with` over a connection in autocommit mode: COMMIT on success, ROLLBACK on error, when one is open."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        return self.db

    def __exit__(self, kind, value, tb) -> None:
        if self.db.in_transaction:
            self.db.execute("COMMIT" if kind is None else "ROLLBACK")


def _ranges(fs, ranges: list[Range]) -> list:
    """Ranges fetched from the object store, all in flight together (store/io/byte_fetch.py)."""
    return fetch_ranges(fs, False, ranges) if ranges else []


def _cut(data, r: Range):
    """A range's bytes out of its whole file's (or the file's fetch error)."""
    if isinstance(data, Exception):
        return data
    start, end = r[1], r[2]
    view = memoryview(data)  # no copy of a file that may be hundreds of MB
    return view[start:] if end is None else view[start:end]


def _size(n: int) -> str:
    """A size as --cache-size is written (stages/settings.format_size): 8796093022208 -> '8T'."""
    for unit, scale in (("P", 1 << 50), ("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and (n * 1000) % scale == 0:
            return f"{n / scale:g}{unit}"
    return str(n)


def _marker(root: str, path: str) -> str:
    return os.path.join(root, ".filling", short_hash(path))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
