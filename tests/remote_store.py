"""`python train.py ARGS` or `python evaluate.py ARGS` reading a store as an object store, with a node
cache whose disk is full (for the tests of the node cache's faults):

    python -m tests.remote_store train|evaluate LOCAL_STORE FULL ARGS...

LOCAL_STORE is copied into fsspec's memory file system, which the command reads as it reads S3 (its
loader workers are forked: they see the same files), as `memory://remote/hs.zarr`: pass that as
--store. FULL says when the node cache's disk fills up: `start` (nothing can be written there: the
index is refused `database or disk is full`), `after:N` (each process keeps N files, then its
writes fail: a file with ENOSPC, the index with `disk I/O error`, as sqlite says when a write fails
under it), or `never` (a disk with room). The fault comes from outside: the wrapper replaces the
cache's sqlite connections and its file writes, so production code carries no test hook. Everything
else is the real command."""

import builtins
import errno
import os
import sqlite3
import sys
from pathlib import Path

import fsspec

from stages.command import run_command
from store.io import node_cache

PROGRAM, LOCAL, FULL = sys.argv.pop(1), Path(sys.argv.pop(1)), sys.argv.pop(1)
STORE = "memory://remote/hs.zarr"
KEEP = None if FULL == "start" else float("inf") if FULL == "never" else int(FULL.removeprefix("after:"))
kept = {"files": 0}


def full() -> bool:
    return KEEP is None or kept["files"] >= KEEP


class FullIndex(sqlite3.Connection):
    """An index on a full disk: reads work, writes fail as sqlite reports them."""

    def execute(self, sql, *args):
        if full() and not sql.lstrip().upper().startswith(("SELECT", "PRAGMA", "ROLLBACK", "BEGIN")):
            raise sqlite3.OperationalError("database or disk is full" if KEEP is None else "disk I/O error")
        return super().execute(sql, *args)


_connect, _open = sqlite3.connect, builtins.open


def connect(*args, **kw):
    return _connect(*args, factory=FullIndex, **kw)


def open_(file, mode="r", *args, **kw):
    if "w" in mode and f"{os.sep}.tmp{os.sep}" in str(file):
        if full():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
        kept["files"] += 1
    return _open(file, mode, *args, **kw)


mem = fsspec.filesystem("memory")
for f in sorted(LOCAL.rglob("*")):
    if f.is_file():
        mem.pipe_file(f"{STORE.removeprefix('memory://')}/{f.relative_to(LOCAL)}", f.read_bytes())
node_cache.sqlite3 = type(sys)("sqlite3_on_a_full_disk")
node_cache.sqlite3.__dict__.update({**sqlite3.__dict__, "connect": connect})
node_cache.open = open_  # the module's writes of cached files (a module global shadows the builtin)
if PROGRAM == "train":
    import train

    run_command(train.main)
else:
    import evaluate

    run_command(evaluate.main)
