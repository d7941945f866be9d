"""One per-sample array (offsets, first_pairs, ...) decoded from its zarr metadata and the bytes of its
one chunk, in the layout schema 2 writes (one chunk: little-endian values, blosc, then crc32c;
store/format/layout.py `small_codecs`), every check passed: the metadata's CRC-32 against the commit
file, the chunk's crc32c, the array's checksum and shape. Anything else raises `NotDirect`, and the
caller reads the array through zarr instead. The one owner of this decoder: the sample index
(store/sample_index.py, many shards in one batch) and a shard's reader (store/shard_reader.py) both
call it.
"""

from __future__ import annotations

import json
import zlib

import google_crc32c
import numpy as np
from numcodecs import Blosc

from store.format import layout
from store.format.read_checks import chunk_separator
from store.format.schema import ShardCommit

_BLOSC = Blosc()  # blosc frames describe themselves: any instance decodes them


class NotDirect(Exception):
    """This shard's arrays are not read here (another layout, or a check failed)."""


def decoded(rec: ShardCommit, name: str, meta, chunk) -> np.ndarray:
    """The array `name` from its metadata and the bytes of its chunk `first_chunk(rec)`, every check
    passed (its metadata names that chunk key encoding); else NotDirect."""
    if not isinstance(meta, bytes) or not isinstance(chunk, bytes) or len(chunk) < 4:
        raise NotDirect
    if (rec.metadata or {}).get(f"{name}/zarr.json") not in (None, zlib.crc32(meta)):
        raise NotDirect
    try:
        m = json.loads(meta)
        shape = m["shape"]
        plain = (
            m.get("zarr_format") == 3
            and len(shape) == 1
            and m["chunk_grid"]["configuration"]["chunk_shape"] == shape
            and m["chunk_key_encoding"] == {"name": "default", "configuration": {"separator": chunk_separator(rec)}}
            and [c["name"] for c in m["codecs"]] == ["bytes", "blosc", "crc32c"]
            and m["codecs"][0]["configuration"]["endian"] == "little"
        )
        dtype = np.dtype(m["data_type"]).newbyteorder("<")
    except (ValueError, KeyError, TypeError, IndexError):
        raise NotDirect from None
    if not plain or shape != rec.shapes.get(name) or dtype != np.dtype(layout.ARRAY_DTYPES[name]).newbyteorder("<"):
        raise NotDirect
    body = chunk[:-4]
    if int.from_bytes(chunk[-4:], "little") != google_crc32c.value(body):
        raise NotDirect
    try:
        raw = _BLOSC.decode(body)
    except Exception:  # noqa: BLE001 - numcodecs' own error on a frame it cannot decode
        raise NotDirect from None
    if len(raw) != shape[0] * dtype.itemsize:
        raise NotDirect
    array = np.frombuffer(raw, dtype).astype(layout.ARRAY_DTYPES[name])
    if layout.crc32(array) != rec.checksums.get(name):
        raise NotDirect
    return array
