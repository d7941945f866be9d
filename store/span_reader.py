"""Token spans of the store's own arrays, read straight from their chunk files.

zarr's general read path costs about half a millisecond a call however little it reads, more
than decoding a sample of the tiny target's states takes, and on an object store it asks a file's
size before each ranged read. For the two layouts a schema-2 store writes with the planes codec,
a span is read here as the byte ranges of the chunks it covers, each chunk checked against its
crc32c before it is decoded, and the states' byte planes are interleaved once, straight into the
output:
  - per-token (and per-sample) arrays: chunks of little-endian values, blosc, then crc32c
    (layout.small_codecs), one object each;
  - states: zarr shard files (index at the end, itself checksummed) of chunks encoded with
    a hidden format's codec, then crc32c (store/format/hidden_formats.py; store/format/shard_file.py writes them),
    each chunk decoded by its codec's `decode_values` (fp8 bytes looked up as bf16 bits straight
    into the output).
`read_spans` reads a batch of spans (of any arrays and shards) in at most two rounds of requests,
each round's in flight together on an object store (store/io/byte_fetch.py): first what the spans'
byte ranges depend on and the store's read cache (store/io/read_cache.py) does not hold (the shard
files' chunk indexes, the per-token arrays' chunks), then the states' bytes: one ranged request
per shard file a span covers, as a file's chunks lie back to back. The chunks a span uses only in
part (its first and last) are kept in the cache for the samples next to it.
`for_array` returns None for any other layout (schema 1, the blosc codec), which zarr reads.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

import google_crc32c
import numpy as np
from numcodecs import Blosc
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ShardingCodec
from zarr.codecs.sharding import ShardingCodecIndexLocation

from store.errors import StoreCorrupt
from store.format import hidden_formats
from store.io.byte_fetch import Range, fetch
from store.io.read_cache import ReadCache

_MISSING = 2**64 - 1  # a shard index's offset and length of a chunk never written (all fill value)
_GONE = "no such file"  # what the cache holds for a file that does not exist
_buffers = threading.local()
_ids = itertools.count()


def _buffer(slot: str, nbytes: int) -> np.ndarray:
    """A uint8 buffer of nbytes, reused by every reader in this thread from chunk to chunk: a
    27B-width chunk is 13 MB, and fresh buffers that size cost more in page faults than decoding
    it; one set per thread (not per reader) keeps a loader's memory flat in the shard count."""
    held = _buffers.__dict__.get(slot)
    if held is None or len(held) < nbytes:
        held = _buffers.__dict__[slot] = np.empty(nbytes, np.uint8)
    return held[:nbytes]


def for_array(
    fs,
    path: str,
    array,
    missing_is_damage: bool = False,
    cache: ReadCache | None = None,
    local: bool | None = None,
    node=None,
) -> SpanReader | None:
    """A direct reader of `array` (a zarr array or its metadata, at `path` on fsspec file system
    `fs`), or None when its layout is not one this module decodes. missing_is_damage: every chunk
    was written (fill-value ones too), so a missing chunk is an error rather than zeros. cache:
    where what it fetches beyond a span is kept (default: nothing kept); local: whether `fs` is a
    local disk (default: asked of fs)."""
    meta = getattr(array, "metadata", array)
    if getattr(meta, "zarr_format", None) != 3 or meta.fill_value != 0:
        return None
    codecs = meta.codecs
    kind = None
    if len(codecs) == 1 and isinstance(codecs[0], ShardingCodec):
        kind = ShardSpans if _plane_shards(codecs[0], meta) else None
    elif (
        len(codecs) == 3
        and _little(codecs[0])
        and isinstance(codecs[1], BloscCodec)
        and isinstance(codecs[2], Crc32cCodec)
    ):
        kind = ChunkSpans
    if kind is None:
        return None
    if local is None:
        local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    reader = kind(fs, local, path, meta, missing_is_damage, ReadCache(0) if cache is None else cache)
    reader.node = None if local else node
    return reader


def _plane_shards(sharding: ShardingCodec, meta) -> bool:
    inner, index = sharding.codecs, sharding.index_codecs
    return (
        sharding.index_location == ShardingCodecIndexLocation.end
        and len(inner) == 3
        and _little(inner[0])
        and isinstance(inner[1], hidden_formats.CODEC_CLASSES)
        and isinstance(inner[2], Crc32cCodec)
        and len(index) == 2
        and _little(index[0])
        and isinstance(index[1], Crc32cCodec)
        and meta.dtype.to_native_dtype().itemsize == 2
        and tuple(sharding.chunk_shape[1:]) == tuple(meta.shape[1:])
    )


def _little(codec) -> bool:
    return isinstance(codec, BytesCodec) and (codec.endian is None or codec.endian.value == "little")


@dataclass
class Span:
    """Rows a .. b of one reader's array, decoded into out when given."""

    reader: SpanReader
    a: int
    b: int
    out: np.ndarray | None = None


@dataclass
class Part:
    """Bytes a span's decoding needs: one range of a file (None: held already, in `data`) and the
    chunks in them, as (chunk, offset in the bytes, length)."""

    range: Range | None
    chunks: list[tuple[int, int, int]]
    data: object = None
    edges: set = field(default_factory=set)  # chunks the span uses only in part: kept in the cache


def read_spans(spans: list[Span]) -> list:
    """Each span's rows ([b - a, *shape[1:]] of its array's dtype, `out` when given), or in its
    place the exception its read raised (StoreCorrupt: damaged or missing; OSError: not read).
    All readers read one store (one file system). On a local disk spans are read one after another
    (a batch saves no round trip there, and one span's bytes at a time sit in the reused buffer)."""
    if spans and spans[0].reader.local:
        return [_read_batch([s])[0] for s in spans]
    return _again_from_store(spans, _read_batch(spans))


def _again_from_store(spans: list[Span], out: list) -> list:
    """Spans whose read through the node-local cache failed a check read once more, their files'
    cached copies dropped first (so fetched from the object store): only a failure there is the
    store's, never a fault of the node's disk."""
    again = [k for k, (s, got) in enumerate(zip(spans, out)) if isinstance(got, StoreCorrupt) and s.reader.node]
    if not again:
        return out
    for k in again:
        s = spans[k]
        s.reader.node.drop([r[0] for r in s.reader.needs(s.a, s.b)])
    for k, got in zip(again, _read_batch([spans[k] for k in again])):
        out[k] = got
    return out


def _fetch(reader: SpanReader, ranges: list[Range]) -> list:
    """byte_fetch.fetch on the reader's file system, through the node-local cache when it has one."""
    if reader.node is not None:
        return reader.node.fetch(reader.fs, ranges)
    return fetch(reader.fs, reader.local, ranges)


def _read_batch(spans: list[Span]) -> list:
    known = _first_round(spans)
    plans = []
    for s in spans:
        try:
            plans.append(s.reader.parts(s.a, s.b, known))
        except Exception as e:  # noqa: BLE001 - a damaged index, a failed fetch: this span's result
            plans.append(e)
    ranges = list(
        dict.fromkeys(p.range for plan in plans if isinstance(plan, list) for p in plan if p.range is not None)
    )
    if ranges:
        got = dict(zip(ranges, _fetch(spans[0].reader, ranges)))
        for plan in plans:
            for p in plan if isinstance(plan, list) else ():
                if p.range is not None:
                    p.data = got[p.range]
    out = []
    for s, plan in zip(spans, plans):
        try:
            if isinstance(plan, Exception):
                raise plan
            out.append(s.reader.decode(s.a, s.b, known, plan, s.out))
        except Exception as e:  # noqa: BLE001 - reported per span: the caller decides
            out.append(e)
    return out


def _first_round(spans: list[Span]) -> dict:
    """(reader id, range) -> the value its reader took from the range's bytes, for every range the
    spans' plans depend on: from the cache, or fetched now (all at once) and then cached."""
    known, wanted = {}, {}
    for s in spans:
        for r in s.reader.needs(s.a, s.b):
            key = (s.reader.id, r)
            if key in known or key in wanted:
                continue
            held = s.reader.cache.get(key)
            if held is None:
                wanted[key] = s.reader
            else:
                known[key] = held
    if wanted:
        first = next(iter(wanted.values()))
        for (key, reader), data in zip(wanted.items(), _fetch(first, [k[1] for k in wanted])):
            try:
                known[key] = reader.take(key[1], data)
                reader.cache.put(key, known[key])
            except Exception as e:  # noqa: BLE001 - damaged or not fetched: the spans that need it fail
                known[key] = e
    return known


class SpanReader:
    """Rows a .. b (along the first axis) of one array; subclasses say which bytes a span needs
    and decode one chunk."""

    node = None  # the node-local cache its fetches go through (store/io/node_cache.StoreFiles), if any

    def __init__(
        self, fs, local: bool, path: str, meta, chunk_rows: int, missing_is_damage: bool, cache: ReadCache
    ) -> None:
        self.fs, self.local, self.path = fs, local, path.rstrip("/")
        self.missing_is_damage, self.cache = missing_is_damage, cache
        self.id = next(_ids)  # this reader's entries in the cache (a reader opened later reads afresh)
        self.shape = meta.shape
        self.dtype = meta.dtype.to_native_dtype()
        self.chunk_rows = chunk_rows
        self.row_values = int(np.prod(self.shape[1:]))  # values per row (per token)
        self._key = meta.encode_chunk_key

    def read(self, a: int, b: int, out: np.ndarray | None = None) -> np.ndarray:
        """[b - a, *shape[1:]] of the array's dtype, decoded into `out` when given (C-contiguous)."""
        got = read_spans([Span(self, a, b, out)])[0]
        if isinstance(got, Exception):
            raise got
        return got

    def needs(self, a: int, b: int) -> list[Range]:
        """What the span's plan depends on (the first round)."""
        self._check(a, b)
        return []

    def take(self, r: Range, data):
        """The value kept of a first-round range's bytes (checked), or _GONE for no such file."""
        if isinstance(data, FileNotFoundError):
            return _GONE
        if isinstance(data, Exception):
            raise data
        return self._take(r, data)

    def parts(self, a: int, b: int, known: dict) -> list[Part]:
        """The bytes the span's decoding needs (the second round)."""
        return []

    def decode(self, a: int, b: int, known: dict, parts: list[Part], out: np.ndarray | None) -> np.ndarray:
        if out is None:
            out = np.empty((b - a, *self.shape[1:]), self.dtype)
        assert out.shape == (b - a, *self.shape[1:]) and out.dtype == self.dtype and out.flags.c_contiguous
        self._decode_span(a, b, known, parts, out)
        return out

    def _check(self, a: int, b: int) -> None:
        if not 0 <= a <= b <= self.shape[0]:
            raise IndexError(f"{self.path}: rows {a}:{b} of {self.shape[0]}")

    def _chunks(self, a: int, b: int):
        """(chunk, first row in it, rows a .. b's slice in the span) of each chunk the span covers."""
        n = self.chunk_rows
        for c in range(a // n, (b + n - 1) // n if b > a else 0):
            lo, hi = max(a, c * n), min(b, (c + 1) * n)
            yield c, lo - c * n, slice(lo - a, hi - a)

    def _known(self, known: dict, r: Range):
        value = known[(self.id, r)]
        if isinstance(value, Exception):
            raise value
        return value

    def _fill(self, out: np.ndarray, what: str) -> None:
        """A chunk that has no bytes: zeros when zarr may have skipped it as all fill value, else damage."""
        if self.missing_is_damage:
            raise StoreCorrupt(
                f"{what} is missing (every chunk of this shard was written: the file was deleted or cut short)"
            )
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

    def _take(self, r: Range, data) -> object:
        raise NotImplementedError

    def _decode_span(self, a: int, b: int, known: dict, parts: list[Part], out: np.ndarray) -> None:
        raise NotImplementedError


class ChunkSpans(SpanReader):
    """A regular chunked array: each chunk one object, blosc then crc32c, fetched whole (the first
    round) and kept decoded in the cache."""

    def __init__(self, fs, local: bool, path: str, meta, missing_is_damage: bool, cache: ReadCache) -> None:
        super().__init__(fs, local, path, meta, meta.chunk_grid.chunk_shape[0], missing_is_damage, cache)
        self._blosc = Blosc()  # blosc frames describe themselves: any instance decodes them

    def needs(self, a: int, b: int) -> list[Range]:
        self._check(a, b)
        return [(self._file((c,)), 0, None) for c, _, _ in self._chunks(a, b)]  # from byte 0: one GET, no HEAD

    def _take(self, r: Range, data) -> np.ndarray:
        values = np.empty((self.chunk_rows, *self.shape[1:]), self.dtype)
        self._blosc.decode(self._checked(data, r[0]), out=values)
        return values

    def _decode_span(self, a, b, known, parts, out) -> None:
        for c, first, rows in self._chunks(a, b):
            r = (self._file((c,)), 0, None)
            values = self._known(known, r)
            if isinstance(values, str):
                self._fill(out[rows], r[0])
            else:
                out[rows] = values[first : first + rows.stop - rows.start]


class ShardSpans(SpanReader):
    """A sharded array of bf16 bits: each shard file's chunks encoded by a hidden format's codec
    (store/format/hidden_formats.py). The first round reads the files' indexes, the second the chunks' bytes."""

    def __init__(self, fs, local: bool, path: str, meta, missing_is_damage: bool, cache: ReadCache) -> None:
        sharding = meta.codecs[0]
        super().__init__(fs, local, path, meta, sharding.chunk_shape[0], missing_is_damage, cache)
        self.per_file = meta.chunk_grid.chunk_shape[0] // self.chunk_rows
        self.codec = sharding.codecs[1]

    def _index_range(self, s: int) -> Range:
        return (self._file((s,)), -(16 * self.per_file + 4), None)  # the file's last bytes: one GET

    def needs(self, a: int, b: int) -> list[Range]:
        self._check(a, b)
        return list(dict.fromkeys(self._index_range(c // self.per_file) for c, _, _ in self._chunks(a, b)))

    def _take(self, r: Range, data) -> np.ndarray:
        """[per_file, 2] uint64 (offset, length) of a shard file's chunks."""
        n = -r[1]
        if len(data) != n:
            raise StoreCorrupt(f"{r[0]}: {len(data)} bytes, shorter than its shard index ({n})")
        return self._checked(data, f"{r[0]}, shard index").view("<u8").reshape(self.per_file, 2).copy()

    def _where(self, c: int, known: dict) -> tuple[str, int, int]:
        """(file, offset, length) of chunk c; offset _MISSING: it has no bytes."""
        s, k = divmod(c, self.per_file)
        r = self._index_range(s)
        index = self._known(known, r)
        if isinstance(index, str):
            return r[0], _MISSING, 0
        return r[0], int(index[k, 0]), int(index[k, 1])

    def parts(self, a: int, b: int, known: dict) -> list[Part]:
        """One range per run of chunks lying back to back in a file; a chunk held in the cache (an
        edge a neighbouring span fetched) or with no bytes gets a part of its own with no range."""
        parts, run = [], None
        chunks = list(self._chunks(a, b))
        for j, (c, first, rows) in enumerate(chunks):
            edge = rows.stop - rows.start < self.chunk_rows
            path, offset, length = self._where(c, known)
            held = self.cache.get((self.id, c)) if edge and not self.local else None  # a disk needs no cache
            if offset == _MISSING or held is not None:
                parts.append(Part(None, [(c, 0, 0 if held is None else len(held))], data=held))
                run = None
                continue
            if run is not None and run.range[0] == path and run.range[2] == offset:
                run.chunks.append((c, offset - run.range[1], length))
                run.range = (path, run.range[1], offset + length)
            else:
                run = Part((path, offset, offset + length), [(c, 0, length)])
                parts.append(run)
            if edge:
                run.edges.add(c)
        return parts

    def _decode_span(self, a, b, known, parts, out) -> None:
        rows_of = {c: (first, rows) for c, first, rows in self._chunks(a, b)}
        for p in parts:
            data = p.data
            if isinstance(data, Exception):
                raise data
            if p.range is not None and len(data) != p.range[2] - p.range[1]:
                raise StoreCorrupt(
                    f"{p.range[0]}: ends {p.range[2] - p.range[1] - len(data)} bytes short of chunk "
                    f"bytes {p.range[1]}..{p.range[2]}"
                )
            for c, at, length in p.chunks:
                first, rows = rows_of[c]
                path, _, _ = self._where(c, known)
                what = f"{path}, chunk {c % self.per_file}"
                if data is None:
                    self._fill(
                        out[rows],
                        what
                        if isinstance(self._known(known, self._index_range(c // self.per_file)), np.ndarray)
                        else path,
                    )
                    continue
                body = self._checked(data[at : at + length], what) if p.range is not None else data
                if c in p.edges and not self.local and self.cache.max_bytes:
                    self.cache.put((self.id, c), np.array(body))  # checked: a neighbour decodes it as it is
                self._decode(body, first, out[rows])

    def _decode(self, body: np.ndarray, first_row: int, out: np.ndarray) -> None:
        """A chunk's checked bytes (less their crc32c), its rows from first_row on, into out."""
        self.codec.decode_values(body, self.chunk_rows * self.row_values, first_row * self.row_values, out, _buffer)
