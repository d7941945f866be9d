"""Token spans of the store's own arrays, read straight from their chunk files.

zarr's general read path costs about half a millisecond a call however little it reads, more
than decoding a sample of the tiny target's states takes. For the two layouts a schema-2 store
writes with the planes codec, a span is read here as the few chunk objects it covers (byte ranges
of a shard file for the states), each checked against its crc32c before it is decoded, and the
states' byte planes are interleaved once, straight into the output:
  - per-token arrays: chunks of little-endian values, blosc, then crc32c (layout.small_codecs);
  - states: zarr shard files (index at the end, itself checksummed) of chunks encoded with
    `dflash.bf16_planes` or `dflash.fp8_e4m3`, then crc32c (layout.state_codecs; store/shard_file.py
    writes them); fp8 bytes are looked up as bf16 bits straight into the output.
`for_array` returns None for any other layout (schema 1, the blosc codec), which zarr reads.
"""

from __future__ import annotations

import functools
import threading

import google_crc32c
import numpy as np
import zarr
from numcodecs import Blosc
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ShardingCodec
from zarr.codecs.sharding import ShardingCodecIndexLocation

from store.codec import Bf16Planes, interleave
from store.errors import StoreCorrupt
from store.fp8_codec import Fp8E4m3

_MISSING = 2**64 - 1  # a shard index's offset and length of a chunk never written (all fill value)
_INDEX_CACHE = 256  # shard-file indexes kept per array (260 bytes each at 16 chunks a file)
_buffers = threading.local()


def _buffer(slot: str, nbytes: int) -> np.ndarray:
    """A uint8 buffer of nbytes, reused by every reader in this thread from chunk to chunk: a
    27B-width chunk is 13 MB, and fresh buffers that size cost more in page faults than decoding
    it; one set per thread (not per reader) keeps a loader's memory flat in the shard count."""
    held = _buffers.__dict__.get(slot)
    if held is None or len(held) < nbytes:
        held = _buffers.__dict__[slot] = np.empty(nbytes, np.uint8)
    return held[:nbytes]


def for_array(fs, path: str, array: zarr.Array, missing_is_damage: bool = False) -> SpanReader | None:
    """A direct reader of `array` (at `path` on fsspec file system `fs`), or None when its layout
    is not one this module decodes. missing_is_damage: every chunk was written (fill-value ones
    too), so a missing chunk is an error rather than zeros."""
    meta = array.metadata
    if getattr(meta, "zarr_format", None) != 3 or meta.fill_value != 0:
        return None
    codecs = meta.codecs
    if len(codecs) == 1 and isinstance(codecs[0], ShardingCodec):
        return ShardSpans(fs, path, array, missing_is_damage) if _plane_shards(codecs[0], meta) else None
    if (len(codecs) == 3 and _little(codecs[0]) and isinstance(codecs[1], BloscCodec)
            and isinstance(codecs[2], Crc32cCodec)):
        return ChunkSpans(fs, path, array, missing_is_damage)
    return None


def _plane_shards(sharding: ShardingCodec, meta) -> bool:
    inner, index = sharding.codecs, sharding.index_codecs
    return (sharding.index_location == ShardingCodecIndexLocation.end
            and len(inner) == 3 and _little(inner[0]) and isinstance(inner[1], (Bf16Planes, Fp8E4m3))
            and isinstance(inner[2], Crc32cCodec) and len(index) == 2 and _little(index[0])
            and isinstance(index[1], Crc32cCodec) and meta.dtype.to_native_dtype().itemsize == 2
            and tuple(sharding.chunk_shape[1:]) == tuple(meta.shape[1:]))


def _little(codec) -> bool:
    return isinstance(codec, BytesCodec) and (codec.endian is None or codec.endian.value == "little")


class SpanReader:
    """Rows a .. b (along the first axis) of one array; subclasses decode one chunk."""

    def __init__(self, fs, path: str, array: zarr.Array, chunk_rows: int, missing_is_damage: bool) -> None:
        self.fs, self.path = fs, path.rstrip("/")
        self.missing_is_damage = missing_is_damage
        self.shape = array.metadata.shape
        self.dtype = array.metadata.dtype.to_native_dtype()
        self.chunk_rows = chunk_rows
        self.row_values = int(np.prod(self.shape[1:]))  # values per row (per token)
        self._key = array.metadata.encode_chunk_key

    def read(self, a: int, b: int, out: np.ndarray | None = None) -> np.ndarray:
        """[b - a, *shape[1:]] of the array's dtype, decoded into `out` when given (C-contiguous)."""
        if not 0 <= a <= b <= self.shape[0]:
            raise IndexError(f"{self.path}: rows {a}:{b} of {self.shape[0]}")
        if out is None:
            out = np.empty((b - a, *self.shape[1:]), self.dtype)
        assert out.shape == (b - a, *self.shape[1:]) and out.dtype == self.dtype and out.flags.c_contiguous
        n = self.chunk_rows
        for c in range(a // n, (b + n - 1) // n if b > a else 0):
            lo, hi = max(a, c * n), min(b, (c + 1) * n)
            self._decode(c, lo - c * n, out[lo - a:hi - a])
        return out

    def _decode(self, c: int, first_row: int, out: np.ndarray) -> None:
        raise NotImplementedError

    def _fill(self, out: np.ndarray, what: str) -> None:
        """A chunk that has no bytes: zeros when zarr may have skipped it as all fill value, else damage."""
        if self.missing_is_damage:
            raise StoreCorrupt(f"{what} is missing (every chunk of this shard was written: the file was deleted or "
                               "cut short)")
        out[...] = 0

    def _file(self, c: tuple[int, ...]) -> str:
        return f"{self.path}/{self._key((*c, *[0] * (len(self.shape) - len(c))))}"

    def _checked(self, data, what: str) -> np.ndarray:
        """A chunk's bytes (bytes or uint8 array) less the crc32c at their end, which must match.
        what: the file and part."""
        data = np.frombuffer(data, np.uint8)
        body, stored = data[:-4], int(data[-4:].view("<u4")[0]) if len(data) >= 4 else -1  # a view: no copy
        if len(data) < 4 or google_crc32c.value(body) != stored:
            raise StoreCorrupt(f"{what} fails its crc32c checksum ({len(data)} bytes): the file is damaged")
        return body


class ChunkSpans(SpanReader):
    """A regular chunked array: each chunk one object, blosc then crc32c."""

    def __init__(self, fs, path: str, array: zarr.Array, missing_is_damage: bool) -> None:
        super().__init__(fs, path, array, array.metadata.chunk_grid.chunk_shape[0], missing_is_damage)
        self._blosc = Blosc()  # blosc frames describe themselves: any instance decodes them

    def _decode(self, c: int, first_row: int, out: np.ndarray) -> None:
        key = self._file((c,))
        try:
            data = self.fs.cat_file(key, start=0)  # one GET on an object store (store/commit_file.py cat_many)
        except FileNotFoundError:
            self._fill(out, key)
            return
        values = _buffer("values", self.chunk_rows * self.row_values * self.dtype.itemsize).view(self.dtype)
        values = values.reshape(-1, *self.shape[1:])
        self._blosc.decode(self._checked(data, key), out=values)
        out[...] = values[first_row:first_row + len(out)]


class ShardSpans(SpanReader):
    """A sharded array of bf16 bits: each shard file's chunks encoded by `dflash.bf16_planes` or
    `dflash.fp8_e4m3`."""

    def __init__(self, fs, path: str, array: zarr.Array, missing_is_damage: bool) -> None:
        sharding = array.metadata.codecs[0]
        super().__init__(fs, path, array, sharding.chunk_shape[0], missing_is_damage)
        self.per_file = array.metadata.chunk_grid.chunk_shape[0] // self.chunk_rows
        self.codec = sharding.codecs[1]
        self._index = functools.lru_cache(_INDEX_CACHE)(self._read_index)

    def _read_index(self, s: int) -> np.ndarray | None:
        """[per_file, 2] uint64 (offset, length) of shard file s's chunks; None: no file."""
        n, key = 16 * self.per_file + 4, self._file((s,))
        try:
            data = self.fs.cat_file(key, start=-n)
        except FileNotFoundError:
            return None
        if len(data) != n:
            raise StoreCorrupt(f"{key}: {len(data)} bytes, shorter than its shard index ({n})")
        return self._checked(data, f"{key}, shard index").view("<u8").reshape(self.per_file, 2).copy()

    def _decode(self, c: int, first_row: int, out: np.ndarray) -> None:
        s, k = divmod(c, self.per_file)
        index = self._index(s)
        offset, length = (_MISSING, _MISSING) if index is None else (int(index[k, 0]), int(index[k, 1]))
        key = self._file((s,))
        if offset == _MISSING:
            self._fill(out, key if index is None else f"{key}, chunk {k}")
            return
        data = self._checked(self._read_range(key, offset, length), f"{key}, chunk {k}")
        values = self.chunk_rows * self.row_values
        if isinstance(self.codec, Fp8E4m3):
            codes, ks = self.codec.codes(data, into=_buffer("codes", values))
            per_row = self.row_values // self.codec.group  # scale groups per row: one a tap
            first, n = first_row * per_row, len(out) * per_row
            self.codec.decode_codes(codes[first:first + n], ks[first:first + n], out=out.reshape(n, -1))
            return
        high, low = self.codec.planes(data, into=_buffer("planes", 2 * values).reshape(2, -1))
        first, n = first_row * self.row_values, out.size
        interleave(high[first:first + n], low[first:first + n], out)

    def _read_range(self, key: str, offset: int, length: int) -> np.ndarray:
        """Bytes offset .. offset + length of a file, read into this thread's reused buffer."""
        buf = _buffer("bytes", length)
        with self.fs.open(key, "rb") as f:
            f.seek(offset)
            got = f.readinto(memoryview(buf))
        if got != length:
            raise StoreCorrupt(f"{key}: ends {length - got} bytes short of chunk bytes {offset}..{offset + length}")
        return buf
