"""Reads samples back from committed shards (what training and evaluation consume)."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass

import numpy as np
import torch
from zarr.core.group import GroupMetadata
from zarr.core.sync import sync

from store import span_reader
from store.errors import StoreCorrupt, StoreMismatch
from store.format import layout, per_sample_array
from store.format.read_checks import first_chunk
from store.format.schema import ShardCommit
from store.hidden_store import HiddenStore
from store.io import zarr_files

_PER_TOKEN = ("tokens", "loss_mask", "hidden")
_PER_SAMPLE = ("offsets", "prompt_lens", "row_ids", "first_pairs")


@dataclass(frozen=True)
class Sample:
    shard: int
    index: int  # position within the shard
    row_id: int  # dataset row
    tokens: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool, True exactly on completion tokens
    prompt_len: int
    hidden: torch.Tensor  # [T, n_taps, H] bf16
    final_state: torch.Tensor | None = None  # [T, H] bf16: the target's state after its final norm, when asked for


class ShardReader:
    """One committed shard. Opening it fetches, in one batch of requests (concurrent on an object
    store), every metadata file its commit record vouches for and the chunk of each per-sample
    array, and checks the metadata against the record's CRC-32s; zarr parses what was fetched and
    reads nothing itself (store/io/zarr_files.py). The per-sample arrays (O(samples) bytes) are
    decoded from those chunks, each on first use (the layout schema 2 writes; any other is read
    through zarr); a sample's tokens, loss mask and states are read as its own span (only the
    chunks it covers), so a reader's memory is bounded by what it is asked for, not by the shard.
    The spans of a schema-2 planes store are read straight from their chunk files
    (store/span_reader.py), any other layout's through zarr. One reader per thread: it reuses its
    decoding buffers."""

    def __init__(self, store: HiddenStore, shard: int, record: ShardCommit | None = None) -> None:
        """record: the shard's commit record when the caller has just read it (not read again)."""
        self.store, self.shard = store, shard
        self.record = record or store.commit_record(shard)
        if self.record is None:
            store.require_committed([shard])
        names = [
            *sorted({*(self.record.metadata or {}), "zarr.json", *(f"{n}/zarr.json" for n in self.record.shapes)}),
            *(f"{n}/{first_chunk(self.record)}" for n in _PER_SAMPLE if n in self.record.shapes),
        ]  # one chunk each
        group = layout.shard_group(shard)
        self._files = {
            name.removeprefix(f"{group}/"): data for name, data in store.fetch([f"{group}/{n}" for n in names]).items()
        }
        store.check_shard_files(shard, self.record, self._files)
        self._meta: dict = {}
        try:
            zarr_files.parse(self._files.pop("zarr.json"), self._path("zarr.json"), GroupMetadata)
        except StoreCorrupt as e:
            raise self._damaged(e) from None

    @functools.cached_property
    def _per_token(self) -> list:
        """The per-token arrays' zarr handles (over the metadata fetched at opening), for the layouts
        read through zarr."""
        return [self._open(name) for name in _PER_TOKEN]

    @property
    def hidden(self):
        """The states' zarr handle."""
        return self._per_token[-1]

    @property
    def has_final_state(self) -> bool:
        """Whether the shard holds the target's final states (a store made with --final-state)."""
        return layout.FINAL_STATE in self.record.shapes

    @functools.cached_property
    def _final(self):
        """(direct span reader or None, zarr handle) of the final states. A shard without them: StoreMismatch
        when the store was made without --final-state, else StoreCorrupt naming the shard and what to run."""
        if not self.has_final_state and not self.store.layout.final_state:
            raise StoreMismatch(
                f"{self.store.location}: made without --final-state, so shard {self.shard} holds no final states "
                "(extract a store with --final-state)"
            )
        if not self.has_final_state:
            raise self._damaged(
                StoreCorrupt(
                    f"{self._path(layout.FINAL_STATE)}: missing, though the store keeps a final state per token"
                )
            )
        direct = None
        if self._direct is not None:
            checks = self.store.read_checks({self.shard: self.record})
            direct = span_reader.for_array(
                self.store.fs,
                self._path(layout.FINAL_STATE),
                self._metadata(layout.FINAL_STATE),
                checks.every_chunk(self.shard),
                self.store.cache,
                self.store.local,
                self.store.node_files(self.shard, self.record),
            )
        return direct, self._open(layout.FINAL_STATE)

    @functools.cached_property
    def _direct(self) -> list | None:
        """Direct span readers of the per-token arrays, or None when the store's layout has none
        (store/format/read_checks.py) or its arrays are not one store/span_reader.py decodes (then zarr reads them)."""
        checks = self.store.read_checks({self.shard: self.record})
        if not checks.direct_reads:
            return None
        node = self.store.node_files(self.shard, self.record)  # a node-local cache of its files, if any
        direct = [
            span_reader.for_array(
                self.store.fs,
                self._path(name),
                self._metadata(name),
                checks.every_chunk(self.shard),
                self.store.cache,
                self.store.local,
                node,
            )
            for name in _PER_TOKEN
        ]
        return None if None in direct else direct

    def _path(self, name: str) -> str:
        return self.store.path(f"{layout.shard_group(self.shard)}/{name}")

    def _metadata(self, name: str):
        """The metadata of array `name` (fetched at opening), its shape and dtype checked against the
        commit record."""
        if name not in self._meta:
            try:
                meta = zarr_files.parse(
                    self._files.get(f"{name}/zarr.json", FileNotFoundError(name)), self._path(f"{name}/zarr.json")
                )
            except StoreCorrupt as e:
                raise self._damaged(e) from None
            shape, recorded, dtype = list(meta.shape), self.record.shapes.get(name), meta.dtype.to_native_dtype()
            if shape != recorded or dtype != layout.ARRAY_DTYPES[name]:
                raise self._damaged(
                    StoreCorrupt(
                        f"{self._path(name)}: shape {shape} {dtype}, its commit file "
                        f"says {recorded} {np.dtype(layout.ARRAY_DTYPES[name])}"
                    )
                )
            self._meta[name] = meta
            self._files.pop(f"{name}/zarr.json", None)  # a kept reader holds the parse, not the bytes
        return self._meta[name]

    def _open(self, name: str):
        """The zarr array `name`, over its checked metadata (zarr reads it not again)."""
        return zarr_files.handle(
            self.store.store_path, f"{layout.shard_group(self.shard)}/{name}", self._metadata(name)
        )

    def _array(self, name: str) -> np.ndarray:
        """A per-sample array (or the loss mask of an old shard), read whole and checked against the
        commit record's checksum: decoded from the chunk fetched at opening (the layout schema 2
        writes, every check passed: store/format/per_sample_array.py), else read through zarr."""
        meta = self._files.get(f"{name}/zarr.json")
        try:
            data = per_sample_array.decoded(
                self.record, name, meta, self._files.pop(f"{name}/{first_chunk(self.record)}", None)
            )
            self._files.pop(f"{name}/zarr.json", None)
            return data
        except per_sample_array.NotDirect:
            pass
        array = self._open(name)
        try:
            data = array[:]
        except Exception as e:  # noqa: BLE001 - zarr's own error on a chunk it cannot decode
            raise self._damaged(StoreCorrupt(f"{self._path(name)}: unreadable ({type(e).__name__}: {e})"))
        if layout.crc32(data) != self.record.checksums.get(name):
            raise self._damaged(
                StoreCorrupt(
                    f"{self._path(name)}: its CRC-32 is not the one its commit file records "
                    "(a chunk file is damaged, missing or replaced)"
                )
            )
        return data

    offsets = functools.cached_property(lambda self: self._array("offsets"))  # [N+1] int64
    prompt_lens = functools.cached_property(lambda self: self._array("prompt_lens"))  # [N] int32
    row_ids = functools.cached_property(lambda self: self._array("row_ids"))  # [N] int64

    @functools.cached_property
    def first_pairs(self) -> np.ndarray:
        """[N] int32: per sample, the first position whose token and the next carry the loss (-1:
        none). Written since schema 2; computed from the whole loss mask for older shards."""
        if "first_pairs" in self.record.shapes:
            return self._array("first_pairs")
        return layout.first_pairs(self._array("loss_mask"), self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> Sample:
        return self.read(i)

    def read(
        self, i: int, limit: int | None = None, hidden_out: torch.Tensor | None = None, final_state: bool = False
    ) -> Sample:
        """Sample i, its first `limit` tokens only when given (only those chunks are read).
        hidden_out: a C-contiguous [n, n_taps, H] bf16 tensor (n: the tokens read) to decode the
        states straight into, such as a row of a training batch; it is then the sample's `hidden`.
        final_state: its final states too (`Sample.final_state`; a shard without them is an error)."""
        got = read_samples([(self, i, limit, hidden_out)], final_state)[0]
        if isinstance(got, Exception):
            raise got
        return got

    def _span(self, i: int, limit: int | None, hidden_out: torch.Tensor | None) -> tuple[int, int, np.ndarray | None]:
        """Sample i's token rows a, b (its first `limit` only) and the bits view of hidden_out."""
        if not 0 <= i < len(self):
            raise IndexError(i)
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        if limit is not None:
            b = min(b, a + limit)
        assert hidden_out is None or (
            hidden_out.is_contiguous() and hidden_out.shape == (b - a, *self._metadata("hidden").shape[1:])
        )
        return a, b, None if hidden_out is None else layout.to_bits(hidden_out)  # a view of it

    def _through_zarr(self, i: int, a: int, b: int, out: np.ndarray | None) -> tuple:
        """Sample i's tokens, loss mask and states bits, read by zarr (layouts span_reader does not decode)."""
        try:
            tokens, mask, bits = sync(_spans(slice(a, b), *self._per_token))
        except (ValueError, RuntimeError, OSError) as e:  # zarr's own error on a chunk it cannot decode (schema 1)
            raise self._damaged(
                StoreCorrupt(f"{self._path(self._failing(a, b))}: unreadable ({type(e).__name__}: {e})"), i
            ) from None
        if out is not None:
            out[...], bits = bits, out
        return tokens, mask, bits

    def _sample(self, i: int, tokens, mask, bits, hidden_out: torch.Tensor | None, final=None) -> Sample:
        """final: the final states' bits ([T, H] uint16), when read."""
        return Sample(
            shard=self.shard,
            index=i,
            row_id=int(self.row_ids[i]),
            tokens=torch.from_numpy(np.asarray(tokens).astype(np.int64)),
            loss_mask=torch.from_numpy(np.asarray(mask).astype(bool)),
            prompt_len=int(self.prompt_lens[i]),
            hidden=layout.from_bits(np.asarray(bits)) if hidden_out is None else hidden_out,
            final_state=None if final is None else layout.from_bits(np.asarray(final)),
        )

    def _final_through_zarr(self, i: int, a: int, b: int) -> np.ndarray:
        """Sample i's final states' bits, read by zarr (layouts span_reader does not decode)."""
        try:
            return self._final[1][a:b]
        except (ValueError, RuntimeError, OSError) as e:
            raise self._damaged(
                StoreCorrupt(f"{self._path(layout.FINAL_STATE)}: unreadable ({type(e).__name__}: {e})"), i
            ) from None

    def _failing(self, a: int, b: int) -> str:
        """The per-token array whose span a:b zarr cannot decode (after a read of all three failed)."""
        for name, array in zip(_PER_TOKEN, self._per_token):
            try:
                array[a:b]
            except (ValueError, RuntimeError, OSError):
                return name
        return ""

    def tokens(self, i: int) -> np.ndarray:
        """Sample i's tokens only ([T] int32 as stored: prompt, then completion), no states read."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        try:
            return np.asarray(self._direct[0].read(a, b) if self._direct is not None else self._per_token[0][a:b])
        except StoreCorrupt as e:
            raise self._damaged(e, i) from None

    def _damaged(self, e: StoreCorrupt, i: int | None = None) -> StoreCorrupt:
        """A failed read (of sample i), with where it is and what to run about it."""
        return self.store.shard_damage(e, self.shard, i)

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]


def read_samples(
    items: list[tuple[ShardReader, int, int | None, torch.Tensor | None]], final_state: bool = False
) -> list:
    """The samples (reader, index, limit, hidden_out) of ShardReader.read, read together: the
    spans of every sample a direct reader holds in one batch of requests (store/span_reader.py:
    on an object store at most two rounds, each in flight at once), the others through zarr. Each
    result is its Sample or, in its place, the StoreCorrupt its read raised (damaged or missing,
    naming the shard, sample and what to run) or the OSError of a fetch that failed. final_state:
    each sample's final states too (a shard without them: its StoreCorrupt)."""
    results: list = [None] * len(items)
    spans, owners = [], []
    names = (*_PER_TOKEN, layout.FINAL_STATE)[: 3 + final_state]
    for k, (reader, i, limit, hidden_out) in enumerate(items):
        try:
            a, b, out = reader._span(i, limit, hidden_out)
            final = reader._final if final_state else None
            if reader._direct is None or (final is not None and final[0] is None):
                got = reader._through_zarr(i, a, b, out)
                results[k] = reader._sample(i, *got, hidden_out, reader._final_through_zarr(i, a, b) if final else None)
                continue
        except (StoreCorrupt, StoreMismatch) as e:
            results[k] = e
            continue
        readers = [*reader._direct, *([final[0]] if final else [])]
        spans += [span_reader.Span(r, a, b, o) for r, o in zip(readers, (None, None, out, None))]
        owners.append(k)
    got = span_reader.read_spans(spans)
    n_spans = len(names)
    for n, k in enumerate(owners):
        reader, i, _, hidden_out = items[k]
        parts = got[n_spans * n : n_spans * (n + 1)]
        failed = next(((name, x) for name, x in zip(names, parts) if isinstance(x, Exception)), None)
        if failed is None:
            results[k] = reader._sample(i, *parts[:3], hidden_out, parts[3] if final_state else None)
        elif isinstance(failed[1], StoreCorrupt):
            results[k] = reader._damaged(failed[1], i)
        elif isinstance(failed[1], FileNotFoundError):  # there when the reader opened: deleted since
            where = failed[1].filename or reader._path(failed[0])
            results[k] = reader._damaged(StoreCorrupt(f"{where} is missing (deleted since the shard was opened)"), i)
        else:  # a fetch that failed, bytes a codec refused: the array is unreadable here
            e = failed[1]
            results[k] = reader._damaged(
                StoreCorrupt(f"{reader._path(failed[0])}: unreadable ({type(e).__name__}: {e})"), i
            )
    return results


async def _spans(span: slice, *arrays) -> list:
    """The same span of several arrays, read in one trip to zarr's event loop (zarr's own async
    array API; a trip per array costs about a millisecond)."""
    return await asyncio.gather(*(a._async_array.getitem(span) for a in arrays))
