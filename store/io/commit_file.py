"""Commit files: small JSON records written last and atomically, each sealed by its own checksum,
and vouching for the metadata files zarr parses (their CRC-32s are recorded inside).

A commit file is written to a temporary name and renamed (on object stores: one put), so a crash
never leaves half of one. Any other damage is caught on reading: text that is not JSON, or JSON
whose `self_crc32` (the CRC-32 of the record's canonical JSON, that key left out) does not match.
Files written before the seal existed have no `self_crc32` and are read as they are.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from store.errors import StoreCorrupt

SEAL = "self_crc32"


def canonical(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def seal(obj: dict) -> dict:
    """obj with its seal added."""
    body = {k: v for k, v in obj.items() if k != SEAL}
    return {**body, SEAL: zlib.crc32(canonical(body))}


def read(fs, path: str) -> dict | None:
    """The record at path (seal removed and checked), or None when there is no file. Raises
    StoreCorrupt naming the file when it is not JSON or fails its seal."""
    try:
        data = fs.cat_file(path, start=0)  # start=0: one GET, no HEAD first (see cat_many)
    except FileNotFoundError:
        return None
    return parse(data, path)


def parse(data: bytes, path: str) -> dict:
    """The record in a commit file's bytes (read from path), seal removed and checked."""
    try:
        obj = json.loads(data)
    except ValueError as e:
        raise StoreCorrupt(f"{path}: damaged commit file ({len(data)} bytes, not JSON: {e})") from None
    if not isinstance(obj, dict):
        raise StoreCorrupt(f"{path}: damaged commit file (JSON {type(obj).__name__}, expected an object)")
    if SEAL in obj:
        stored = obj.pop(SEAL)
        if stored != zlib.crc32(canonical(obj)):
            raise StoreCorrupt(f"{path}: damaged commit file (its content fails its {SEAL} checksum)")
    return obj


def write(fs, path: str, obj: dict, local: bool) -> None:
    """Write obj, sealed, atomically (put_atomic)."""
    put_atomic(fs, path, json.dumps(seal(obj), indent=1, sort_keys=True, default=str).encode(), local)


def put_atomic(fs, path: str, data: bytes, local: bool) -> None:
    """Write data so that no reader ever sees part of it: a temporary name then a rename (local),
    else one put."""
    if not local:
        fs.pipe_file(path, data)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a signal: no temporary file left behind
        Path(tmp).unlink(missing_ok=True)
        raise


def cat_many(fs, paths: list[str]) -> list:
    """The bytes of each path, in order, fetched in one batch (on an object store: concurrent GETs,
    one a file, no listing or HEAD first); an exception in place of a file that cannot be read."""
    if not paths:
        return []
    # whole files asked for as the range from byte 0: s3fs then sends one GET (a plain whole-file read
    # asks the size first, to fetch a large object in parts)
    return fs.cat_ranges(paths, [0] * len(paths), [None] * len(paths), on_error="return")


def file_checksums(fs, folder: str, names: list[str]) -> dict[str, int]:
    """{name: CRC-32 of the file folder/name}, for files that exist."""
    out = {}
    for name in names:
        try:
            out[name] = zlib.crc32(fs.cat_file(f"{folder}/{name}", start=0))  # start=0: one GET (see cat_many)
        except FileNotFoundError:
            pass
    return out


def check_files(fs, folder: str, recorded: dict[str, int]) -> None:
    """Every file of `recorded` (name -> CRC-32, from a commit file) exists under folder and matches;
    the files fetched in one batch (cat_many)."""
    names = sorted(recorded)
    check_fetched(folder, recorded, dict(zip(names, cat_many(fs, [f"{folder}/{n}" for n in names]))))


def check_fetched(folder: str, recorded: dict[str, int], got: dict) -> None:
    """check_files on files already fetched: got, name -> its bytes or the exception its fetch
    raised (cat_many), holds every name of `recorded`. A fetch that failed other than for a missing
    file is raised as it is."""
    for name, crc in sorted(recorded.items()):
        path, data = f"{folder}/{name}", got[name]
        if isinstance(data, FileNotFoundError):
            raise StoreCorrupt(f"{path}: missing (its commit file records it)")
        if isinstance(data, Exception):
            raise data
        if zlib.crc32(data) != crc:
            raise StoreCorrupt(f"{path}: damaged ({len(data)} bytes; not the CRC-32 its commit file records)")
