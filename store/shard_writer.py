"""Writes one shard: hidden states stream through a background thread, the commit file goes last.

The model thread hands each batch over with `add` and returns to the next forward. The writer
thread converts to bf16 bits, checksums, and cuts the stream into whole zarr shard files
(`shard_tokens` tokens, so no write ever rewrites a shard object); a pool of `threads` encodes
their chunks (store/format/shard_file.py) while the writer thread goes on taking states and writes each
file, in order, once it is encoded. The states handed over and not yet written are bounded in
bytes (`max_held_bytes`; one batch is always taken): at hidden 5120 one batch of 32 x 4k tokens
is 6.7 GB, so a count of batches would not bound host memory. `commit` drains the queue, writes
the tail and the small per-sample arrays, checks the lock is still ours, and only then writes the
commit file. A store made with --final-state has a second state array, `final_state` ([T, H]), taken
with each batch and cut, encoded and written as `hidden` is. Anything that stops earlier leaves a
shard without a commit file, which no reader trusts and a rerun redoes.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import zarr

from store.errors import StoreError
from store.format import layout, shard_file
from store.format.schema import ShardCommit
from store.store_writer import StoreWriter

_DONE = object()
# Every chunk is written, all-fill-value ones too (zarr skips those by default), so that a reader
# can tell a missing chunk file (damage) from zeros; the commit record says so (`every_chunk`).
_EVERY_CHUNK = {"write_empty_chunks": True}
# Chunk keys c.K.0.0, files beside the array's metadata (format revision 5; store/format/layout.py).
_KEYS = layout.chunk_key_encoding()


@dataclass
class ShardStats:
    samples: int = 0
    tokens: int = 0
    completion_tokens: int = 0
    skipped: dict = field(default_factory=lambda: {r: 0 for r in layout.SKIP_REASONS})
    truncated: int = 0  # completions cut at --max-length / --max-new-tokens without an EOS
    agreement: dict | None = None  # {"matches", "tokens"}: completion tokens equal to the target's argmax
    final_state: dict | None = None  # the check of the stored final states (ShardCommit.final_state)


class ShardWriter:
    def __init__(
        self,
        store: StoreWriter,
        shard: int,
        n_taps: int,
        hidden_size: int,
        chunk_tokens: int,
        shard_tokens: int,
        level: int | None = None,
        max_held_bytes: int = 4 << 30,
        threads: int = 2,
    ) -> None:
        """The states are coded in the hidden format of the store written (store/format/hidden_formats.py):
        fp8 states come already rounded (by the capture), and their codec refuses any that are not."""
        assert shard_tokens % chunk_tokens == 0, (shard_tokens, chunk_tokens)
        self.store, self.shard = store, shard
        self.n_taps, self.hidden_size = n_taps, hidden_size
        self.chunk_tokens, self.shard_tokens = chunk_tokens, shard_tokens
        codecs = store.layout.format.codecs(layout.DEFAULT_LEVEL if level is None else level, hidden_size)
        self.final = store.layout.final_state  # the store's: a final_state array beside hidden
        self.stats = ShardStats()
        self.tokens: list[np.ndarray] = []
        self.loss_mask: list[np.ndarray] = []
        self.prompt_lens: list[int] = []
        self.row_ids: list[int] = []
        self.categories: list[str | None] = []
        self.stall_s = 0.0  # time the model thread waited for the writer
        self.busy_s = 0.0  # time the writer thread spent not waiting for states (its pool's time apart)
        self._written = 0
        self._pending_len = 0  # tokens taken, not yet cut into shard files (the same in every state array)
        self._cut = 0  # tokens cut into shard files so far
        self._encoding: deque[tuple[int, list[list[Future]]]] = deque()  # shard files being encoded, in order
        self._token_bytes = (n_taps + self.final) * hidden_size * 2
        self._max_held_tokens = max(1, max_held_bytes // self._token_bytes)
        self._held_tokens = 0  # handed over, not yet written
        self._queued = 0  # handed over, not yet taken by the writer thread
        self._in_flight = 0  # cut into shard files, not yet written
        self._room = threading.Condition()
        self._error: BaseException | None = None
        store.clear_shard(shard)
        g = zarr.open_group(store.location, mode="a", path=layout.shard_group(shard))
        g.attrs.put({"shard": shard})
        self.group = g
        rows = {"hidden": (n_taps, hidden_size), layout.FINAL_STATE: (hidden_size,)}
        self._states = [
            _StateArray(g, name, rows[name], chunk_tokens, shard_tokens, codecs)
            for name in layout.STATE_ARRAYS[: 1 + self.final]
        ]
        self.hidden = self._states[0].array
        self._queue: queue.Queue = queue.Queue()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"shard-writer-{shard}")
        self._thread = threading.Thread(target=self._run, name=f"shard-writer-{shard}", daemon=True)
        self._thread.start()

    # -- model thread ----------------------------------------------------------------------
    def add(
        self,
        row_id: int,
        prompt: list[int],
        completion: list[int],
        truncated: bool,
        answers: tuple[tuple[int, int], ...] = (),
        category: str | None = None,
    ) -> None:
        """Record one sample's ids; its hidden states come in the batch passed to `add_hidden`.
        answers: [start, end) spans inside the prompt that carry the loss too (earlier assistant turns);
        category: the sample's label (given for every sample of a shard or for none)."""
        self.categories.append(category)
        ids = np.asarray(prompt + completion, dtype=np.int32)
        mask = np.zeros(len(ids), dtype=np.uint8)
        for a, b in answers:
            assert 0 <= a < b <= len(prompt), (a, b, len(prompt))
            mask[a:b] = 1
        mask[len(prompt) :] = 1
        self.tokens.append(ids)
        self.loss_mask.append(mask)
        self.prompt_lens.append(len(prompt))
        self.row_ids.append(row_id)
        self.stats.samples += 1
        self.stats.tokens += len(ids)
        self.stats.completion_tokens += len(completion)
        self.stats.truncated += int(truncated)

    def add_hidden(self, hidden: torch.Tensor, final: torch.Tensor | None = None) -> None:
        """hidden: [t, n_taps, H] bf16 (CPU), the samples just added, concatenated in order; final: [t, H]
        bf16 (CPU), their final states, given exactly when the store keeps them. Waits
        while the writer would then hold more than max_held_bytes, but never while the writer thread
        has taken everything handed over and written every shard file it cut: it is then waiting
        for this batch to fill the next file (so the bound can be passed by one shard file's worth
        plus a batch, never deadlocked)."""
        assert (final is not None) == self.final and (final is None or final.shape == (len(hidden), hidden.shape[-1]))
        t0 = time.perf_counter()
        with self._room:
            while (
                (self._queued or self._in_flight)
                and self._held_tokens + len(hidden) > self._max_held_tokens
                and self._error is None
            ):
                self._room.wait(0.5)
            self._raise_if_failed()
            self._held_tokens += len(hidden)
            self._queued += len(hidden)
        self._queue.put((hidden, final))
        self.stall_s += time.perf_counter() - t0

    def skip(self, reason: str) -> None:
        self.stats.skipped[reason] += 1

    def check_final(self, record: dict) -> None:
        """Add a batch's check of its final states ({"matches", "tokens", "normed", "states"}) to the shard's."""
        held = self.stats.final_state or dict.fromkeys(record, 0)
        self.stats.final_state = {k: held[k] + record[k] for k in record}

    def agree(self, matches: int, tokens: int) -> None:
        """Count completion tokens checked against the target's own argmax, and how many matched."""
        a = self.stats.agreement or {"matches": 0, "tokens": 0}
        self.stats.agreement = {"matches": a["matches"] + matches, "tokens": a["tokens"] + tokens}

    def commit(self, lock, run: dict) -> ShardCommit:
        """Finish the shard and write its commit file; returns the commit record. lock: the shard's
        lock (None on object stores); run: the extractor's notes for the record."""
        self._queue.put(_DONE)
        self._thread.join()
        self._raise_if_failed()
        assert self._written == self.stats.tokens, (self._written, self.stats.tokens)
        arrays = {
            "tokens": _cat(self.tokens, np.int32),
            "loss_mask": _cat(self.loss_mask, np.uint8),
            "offsets": np.concatenate([[0], np.cumsum([len(t) for t in self.tokens])]).astype(np.int64),
            "prompt_lens": np.asarray(self.prompt_lens, dtype=np.int32),
            "row_ids": np.asarray(self.row_ids, dtype=np.int64),
        }
        arrays["first_pairs"] = layout.first_pairs(arrays["loss_mask"], arrays["offsets"])
        for name, data in arrays.items():
            self.group.create_array(
                name,
                shape=data.shape,
                dtype=data.dtype,
                chunks=(max(1, min(len(data), layout.TOKEN_CHUNK)),),
                compressors=layout.small_codecs(),
                fill_value=0,
                config=_EVERY_CHUNK,
                chunk_key_encoding=_KEYS,
            )[:] = data
        checksums = {name: layout.crc32(data) for name, data in arrays.items()}
        checksums.update({a.name: a.crc for a in self._states})
        if lock is not None and not lock.still_held():
            raise StoreError(
                f"{self.store.location}: lost the lock on shard {self.shard} ({lock.path}); not committing"
            )
        record = ShardCommit(
            shard=self.shard,
            samples=self.stats.samples,
            tokens=self.stats.tokens,
            completion_tokens=self.stats.completion_tokens,
            skipped=self.stats.skipped,
            truncated=self.stats.truncated,
            shapes={
                **{a.name: [self.stats.tokens, *a.row_shape] for a in self._states},
                **{k: list(v.shape) for k, v in arrays.items()},
            },
            checksums={"algorithm": "crc32 of the C-order array bytes", **checksums},
            writer={"stall_s": round(self.stall_s, 4), "busy_s": round(self.busy_s, 4)},
            agreement=self.stats.agreement,
            run=run,
            categories=_categories(self.categories),
            bytes=self.store.shard_bytes(self.shard),
            metadata=self.store.shard_metadata(self.shard, [*(a.name for a in self._states), *arrays]),
            every_chunk=True,
            chunk_separator=_KEYS["separator"],
            final_state=self.stats.final_state if self.final else None,
        )
        self.store.write_commit(record)
        self._pool.shutdown()
        return record

    def abort(self) -> None:
        """Stop the writer thread; the shard stays uncommitted."""
        if self._thread.is_alive():
            self._queue.put(_DONE)
            self._thread.join(timeout=30)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"writer for shard {self.shard} failed: {self._error!r}") from self._error

    # -- writer thread ---------------------------------------------------------------------
    def _run(self) -> None:
        """Take states as they come; cut them into whole shard files, whose chunks the pool encodes
        while this thread goes on taking; write each file, in order, once its chunks are encoded."""
        try:
            while True:
                try:  # with files being encoded, never sit waiting for the model: write them
                    item = self._queue.get(block=not self._encoding)
                except queue.Empty:
                    self._write_encoded(wait=True)
                    continue
                if item is _DONE:
                    break
                t0 = time.perf_counter()
                self._take(item)
                self._write_encoded(wait=False)
                self.busy_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            self._finish()
            self.busy_s += time.perf_counter() - t0
        except BaseException as e:  # surfaced in the model thread on its next call
            with self._room:
                self._error = e
                self._room.notify_all()

    def _take(self, item: tuple) -> None:
        hidden, final = item
        with self._room:
            self._queued -= len(hidden)
            self._room.notify_all()
        for states, a in zip((hidden, final), self._states):
            a.take(states)
        self._pending_len += len(hidden)
        while self._pending_len >= self.shard_tokens:
            self._start_file()

    def _start_file(self) -> None:
        """The next whole shard file of each state array: their chunks to the pool."""
        start, end = self._cut, self._cut + self.shard_tokens
        with self._room:
            self._in_flight += self.shard_tokens
        per_file = self.shard_tokens // self.chunk_tokens
        self._encoding.append((start // self.shard_tokens, [a.encode(self._pool, per_file) for a in self._states]))
        self._pending_len -= self.shard_tokens
        self._cut = end

    def _write_encoded(self, wait: bool) -> None:
        """Write the oldest shard files whose chunks are encoded; with wait, wait for the oldest."""
        while self._encoding and (wait or all(f.done() for fs in self._encoding[0][1] for f in fs)):
            index, futures = self._encoding.popleft()
            for a, fs in zip(self._states, futures):
                a.write_file(self.store, self.shard, index, fs)
            self._wrote(self.shard_tokens)
            wait = False

    def _finish(self) -> None:
        """Every shard file written, then the partial last one through zarr, and the final shape."""
        while self._encoding:
            self._write_encoded(wait=True)
        rest = self._pending_len
        if rest:
            with self._room:
                self._in_flight += rest
        for a in self._states:
            a.write_tail(self._cut, rest)
        self._cut += rest
        self._pending_len = 0
        if rest:
            self._wrote(rest)

    def _wrote(self, n: int) -> None:
        self._written += n
        with self._room:
            self._held_tokens -= n
            self._in_flight -= n
            self._room.notify_all()


class _StateArray:
    """One state array of the shard (`hidden` [T, n_taps, H]; `final_state` [T, H]), coded in the store's
    hidden format: its zarr array, the running CRC-32 of its bits, and the bits taken, not yet cut into
    shard files. Every state array of a shard is cut at the same tokens."""

    def __init__(self, group, name: str, row_shape: tuple, chunk_tokens: int, shard_tokens: int, codecs: list):
        self.name, self.row_shape, self.chunk_tokens = name, row_shape, chunk_tokens
        self.array = group.create_array(
            name,
            shape=(0, *row_shape),
            dtype=np.uint16,
            chunks=(chunk_tokens, *row_shape),
            shards=(shard_tokens, *row_shape),
            compressors=codecs,
            fill_value=0,
            config=_EVERY_CHUNK,
            chunk_key_encoding=_KEYS,
        )
        self.codec = codecs[0]  # whole shard files are encoded here, not by zarr
        self.crc = 0
        self.pending: deque[np.ndarray] = deque()

    def take(self, states: torch.Tensor) -> None:
        """states: [t, *row_shape] bf16, the next tokens' (their bits viewed, not copied)."""
        bits = layout.to_bits(states)
        self.crc = layout.crc32(bits, self.crc)
        self.pending.append(bits)

    def encode(self, pool: ThreadPoolExecutor, chunks: int) -> list[Future]:
        """The next `chunks` chunks, each encoded in the pool."""
        return [pool.submit(shard_file.encode_chunk, self.codec, self.pop(self.chunk_tokens)) for _ in range(chunks)]

    def write_file(self, store: StoreWriter, shard: int, index: int, futures: list[Future]) -> None:
        key = self.array.metadata.encode_chunk_key((index, *[0] * len(self.row_shape)))
        store.write_pieces(
            f"{layout.shard_group(shard)}/{self.name}/{key}", shard_file.assemble([f.result() for f in futures])
        )

    def write_tail(self, cut: int, rest: int) -> None:
        """The array resized to its final length, the last `rest` tokens (a partial shard file) through zarr."""
        self.array.resize((cut + rest, *self.row_shape))
        if rest:
            self.array[cut : cut + rest] = self.pop(rest)

    def pop(self, n: int) -> np.ndarray:
        """The next n pending tokens: a view of one batch when they lie in one, else joined."""
        parts, got = [], 0
        while got < n:
            p = self.pending.popleft()
            k = min(len(p), n - got)
            parts.append(p[:k])
            got += k
            if k < len(p):
                self.pending.appendleft(p[k:])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _cat(parts: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


def _categories(per_sample: list[str | None]) -> dict | None:
    """The commit record's categories: the distinct labels (in order of first use) and each sample's code."""
    if not per_sample or per_sample[0] is None:
        assert all(c is None for c in per_sample), "labels for some samples only"
        return None
    labels = list(dict.fromkeys(per_sample))
    code = {label: k for k, label in enumerate(labels)}
    return {"labels": labels, "codes": [code[c] for c in per_sample]}
