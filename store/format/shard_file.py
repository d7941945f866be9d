"""Whole zarr shard files of the states, encoded here instead of through zarr's codec pipeline.

A schema-2 `hidden` array is zarr's sharding codec over `chunk_tokens`-token chunks, each encoded
by `dflash.bf16_planes` (or `dflash.fp8_e4m3`) then `crc32c`, with the shard index (little-endian uint64 offset and
length per chunk, then its crc32c) at the end of the file. For a shard file whose every chunk is
full, this module writes exactly those bytes (a test checks them against zarr's own, byte for
byte) straight from the source array: no copy of a chunk before it is compressed, no joined
buffers, and its chunks compressed in the writer's own thread pool, whose size the user sets.
Anything else (a partial last shard, another codec) goes through zarr.
"""

from __future__ import annotations

import google_crc32c
import numpy as np

from store.format.chunk_codec import PackedCodec

_INDEX = np.dtype("<u8")
_CRC = np.dtype("<u4")


def encode_chunk(codec: PackedCodec, chunk: np.ndarray) -> list:
    """One chunk, [chunk_tokens, n_taps, H] uint16 C-contiguous: its encoded pieces, checksum last."""
    parts = codec.pack_parts(chunk.reshape(-1).view(np.uint8))
    crc = 0
    for p in parts:
        crc = google_crc32c.extend(crc, p)
    return [*parts, np.array([crc], _CRC).tobytes()]


def assemble(chunks: list[list]) -> list:
    """A whole shard file from its chunks' encoded pieces, in order: the pieces, then the index."""
    index = np.empty((len(chunks), 2), _INDEX)
    start = 0
    for k, parts in enumerate(chunks):
        n = sum(len(memoryview(p).cast("B")) for p in parts)
        index[k] = (start, n)
        start += n
    index_bytes = index.tobytes()
    return [p for parts in chunks for p in parts] + [
        index_bytes,
        np.array([google_crc32c.value(index_bytes)], _CRC).tobytes(),
    ]
