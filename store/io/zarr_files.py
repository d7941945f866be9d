"""zarr's files fetched by the store itself, then handed to zarr to parse and decode.

Opened through zarr, each array and group costs requests that wait for each other: its metadata
document (and, for a group, probes for older formats' files), then a size query before each
chunk (s3fs asks an object's size before a whole-object read). On an object store at ~50 ms a
request, opening a shard that way took ~1 s. Here the caller fetches what it needs in one batch
(commit_file.cat_many: concurrent GETs, none of them a HEAD) and checks it against its commit
record; zarr then only parses the metadata (`parse`), builds handles over it without reading it
again (`handle`, for the layouts read through zarr), and decodes chunks fetched in batches from
memory (`read_whole`), so what it decodes is exactly what zarr's own read would return.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math

import numpy as np
import zarr
from zarr.core.array import AsyncArray
from zarr.core.buffer import cpu
from zarr.core.group import GroupMetadata, _build_metadata_v3
from zarr.core.metadata.v3 import ArrayV3Metadata
from zarr.core.sync import sync
from zarr.storage import MemoryStore, StorePath

from store.errors import StoreCorrupt
from store.io import commit_file

ROUND_BYTES = 1 << 30  # decoded bytes of chunks fetched in one batch by read_whole (an embedding at 27B: 2.5 GB)


def parse(data, path: str, kind: type = ArrayV3Metadata) -> ArrayV3Metadata | GroupMetadata:
    """The zarr-3 metadata document `data` (fetched from path: bytes, or the exception its fetch
    raised) as zarr parses it; StoreCorrupt naming the node when it is missing, not JSON or not a
    `kind` (ArrayV3Metadata or GroupMetadata) zarr accepts."""
    node = path.removesuffix("/zarr.json") if kind is ArrayV3Metadata else path
    try:
        if isinstance(data, Exception):
            raise data
        meta = _build_metadata_v3(json.loads(data))
        if not isinstance(meta, kind):
            raise ValueError(f"a {type(meta).__name__}, expected a {kind.__name__}")
        if kind is ArrayV3Metadata and meta.storage_transformers:
            raise ValueError("storage transformers, which zarr does not read")
    except Exception as e:  # noqa: BLE001 - json's, zarr's or the file system's own error
        raise StoreCorrupt(f"{node}: unreadable ({type(e).__name__}: {e})") from None
    return meta


def handle(store_path: StorePath, key: str, meta: ArrayV3Metadata) -> zarr.Array:
    """The zarr array at key of a store, over metadata already read (zarr reads it not again)."""
    return zarr.Array(AsyncArray(metadata=meta, store_path=store_path / key))


def read_whole(fs, arrays: list[tuple[str, ArrayV3Metadata]], round_bytes: int = ROUND_BYTES) -> list:
    """Each array (its path on fsspec file system fs, its metadata), read whole: its chunk files
    fetched in batches of at most round_bytes decoded bytes (all arrays' together, each batch in
    flight at once; one batch for arrays that fit), each decoded by zarr from memory. A chunk file
    that does not exist reads as the fill value, as through zarr. Per array, in order, its values
    or in their place the exception its read raised."""
    blocks = [(k, rows) for k, (_, meta) in enumerate(arrays) for rows in _row_blocks(meta)]
    out: list = [np.empty(meta.shape, meta.dtype.to_native_dtype()) for _, meta in arrays]
    for batch in _batches(blocks, arrays, round_bytes):
        keys = [(k, key) for k, rows in batch for key in _chunk_keys(arrays[k][1], rows)]
        got = commit_file.cat_many(fs, [f"{arrays[k][0].rstrip('/')}/{key}" for k, key in keys])
        held: dict[int, dict] = {k: {} for k, _ in batch}
        for (k, key), data in zip(keys, got):
            if isinstance(data, FileNotFoundError):
                continue
            if isinstance(data, Exception) and not isinstance(out[k], Exception):
                out[k] = data
            elif not isinstance(data, Exception):
                held[k][key] = cpu.Buffer.from_bytes(data)
        live = [(k, rows) for k, rows in batch if not isinstance(out[k], Exception)]
        decoded = sync(_gathered([_decode(arrays[k][1], held[k], rows) for k, rows in live]))
        for (k, rows), values in zip(live, decoded):
            if isinstance(out[k], Exception):
                continue
            if isinstance(values, Exception):
                out[k] = values
            else:
                out[k][rows] = values
    return out


async def _gathered(coros: list) -> list:
    """Each coroutine's result or exception, run together in zarr's event loop."""
    return await asyncio.gather(*coros, return_exceptions=True)


async def _decode(meta: ArrayV3Metadata, chunks: dict, rows: slice):
    array = AsyncArray(metadata=meta, store_path=StorePath(MemoryStore(chunks, read_only=True)))
    return await array.getitem(rows)


def _row_blocks(meta: ArrayV3Metadata) -> list[slice]:
    """The rows of each block of chunks along the first axis."""
    n, step = meta.shape[0], meta.chunk_grid.chunk_shape[0]
    return [slice(a, min(a + step, n)) for a in range(0, n, step)]


def _chunk_keys(meta: ArrayV3Metadata, rows: slice) -> list[str]:
    """The chunk keys of one row block (every chunk along the other axes)."""
    shape, chunks = meta.shape, meta.chunk_grid.chunk_shape
    rest = [range(math.ceil(n / c)) for n, c in zip(shape[1:], chunks[1:])]
    return [meta.encode_chunk_key((rows.start // chunks[0], *c)) for c in itertools.product(*rest)]


def _batches(blocks: list, arrays: list, round_bytes: int):
    """blocks, in batches of at most round_bytes decoded bytes (at least one block each)."""
    batch, size = [], 0
    for k, rows in blocks:
        meta = arrays[k][1]
        n = (rows.stop - rows.start) * math.prod(meta.shape[1:]) * meta.dtype.to_native_dtype().itemsize
        if batch and size + n > round_bytes:
            yield batch
            batch, size = [], 0
        batch.append((k, rows))
        size += n
    if batch:
        yield batch
