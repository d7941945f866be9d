"""Training data order and batches, straight from the store.

`index_samples` lists the trainable samples of the chosen shards (lengths only, no hidden
states) as `Refs`: three parallel int32 arrays, 12 bytes a sample. `epoch_batches` orders them for
one epoch, shuffled by sample with a (seed, epoch) generator (--data-order node: each node's shards'
samples, shuffled within windows of shards, node_order.py), and forms batches (recipe.BATCHINGS):
rows of one sample bucketed by length so padding stays small, rows of one sample in random order,
or packed rows that hold several whole samples each; then deals them to ranks so each rank reads
only its own part; an epoch's batches are `Batches`, arrays too. Both are formed with numpy, no
Python object a sample (a batch becomes a list of rows, a row a tuple of `Ref`, only when it is
read), by every rank alike from the per-sample arrays the main process read and sent
(stages/train/setup.py): at 2.5M samples a rank forms its refs and an epoch in well under a second
and holds 12 bytes a sample of refs and at most 12 of the epoch's batches (docs/performance.md).
Every rank forms them rather than receiving them from the main process: that costs about what
pickling and sending 30-60 MB to every rank would, and needs no exchange (every rank waiting on the
main process) at each epoch's start; the (seed, epoch) generator makes them the same everywhere. `StoreBatches` turns a batch into padded
tensors; it is what DataLoader worker processes run, each with its own store handles.
"""

from __future__ import annotations

import array
import dataclasses
import logging
import math
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from stages.cache_flags import make as node_cache_of
from stages.train.config import DataConfig
from stages.train.node_order import NodeOrder, node_counts, node_samples, shuffled_within
from store.format import layout
from store.errors import ConfigError, NotCommitted, StoreCorrupt, StoreError, redo_hint
from store.hidden_store import HiddenStore
from store.io.node_cache import NodeCache
from store.sample_index import per_sample
from store.format.schema import ShardCommit
from store.shard_reader import ShardReader, read_samples

BUCKET = 64  # batches of similar length are formed within windows of this many batches
PREFETCH = 4  # batches each loader worker keeps ready (in shared memory until the trainer takes them)
SHM = "/dev/shm"  # where DataLoader workers hand batches over (Linux)


@dataclass(frozen=True)
class Ref:
    shard: int
    index: int
    length: int  # tokens used (after --max-length)


@dataclass(frozen=True, eq=False)
class Refs:
    """Samples as parallel arrays, read like a list of Ref: refs[i] is a Ref, refs[slice or index
    array] the Refs of those samples, iteration gives Ref after Ref, + joins."""

    shard: np.ndarray  # [N] int32
    index: np.ndarray  # [N] int32: the sample's number within its shard
    length: np.ndarray  # [N] int32: tokens used (after --max-length)
    # what epoch_batches formed of these refs, so that the launch's epoch length, the epoch's batches
    # and every save's walk over the epochs (position.advance) form an epoch once: the last epoch's
    # batches and every epoch's number of batches, by its arguments
    _last: dict = field(default_factory=dict, init=False, repr=False)
    _counts: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        assert all(a.dtype == np.int32 and a.shape == self.length.shape for a in self._arrays()), \
            "Refs: three int32 arrays of one length"

    @classmethod
    def of(cls, shard, index, length) -> Refs:
        return cls(*(np.asarray(a, dtype=np.int32).reshape(-1) for a in (shard, index, length)))

    def __len__(self) -> int:
        return len(self.length)

    def __getitem__(self, i):
        if isinstance(i, (int, np.integer)):
            return Ref(int(self.shard[i]), int(self.index[i]), int(self.length[i]))
        return Refs(self.shard[i], self.index[i], self.length[i])

    def __iter__(self):
        return map(Ref, self.shard.tolist(), self.index.tolist(), self.length.tolist())

    def __add__(self, other: Refs) -> Refs:
        return Refs(*(np.concatenate([a, b]) for a, b in zip(self._arrays(), other._arrays())))

    def __eq__(self, other) -> bool:
        return isinstance(other, Refs) and all(np.array_equal(a, b) for a, b in zip(self._arrays(), other._arrays()))

    __hash__ = None

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.shard, self.index, self.length


def index_samples(store: HiddenStore, shards: list[int], max_length: int,
                  records: dict[int, ShardCommit] | None = None) -> Refs:
    """Samples with at least one anchor (pipeline/drafter/blocks.py) within max_length, from the
    per-sample index: O(samples) bytes read, not the per-token mask. The first anchor of a sample
    is its first pair of loss tokens (the anchor rule, checked against `anchor_mask` in the tests),
    so an anchor lies within n tokens iff that pair does. records: the store's commit records when
    the caller holds them (store.committed()); every shard's arrays come in one batch of reads
    (store/sample_index.py)."""
    if records is None:
        records, damaged = store.commits()
        for s in shards:
            if s in damaged:
                raise damaged[s]
    if any(s not in records for s in shards):
        store.require_committed([s for s in shards if s not in records])
    return refs_of(per_sample(store, {s: records[s] for s in shards}), shards, max_length)


def refs_of(arrays: dict[int, dict[str, np.ndarray]], shards: list[int], max_length: int) -> Refs:
    """The samples of `shards` with an anchor within max_length (see index_samples), from their
    per-sample arrays: shard -> {offsets: [N+1], first_pairs: [N]}; shard after shard, as `shards` lists them."""
    index, length = [], []
    for shard in shards:
        a = arrays[shard]
        n = np.minimum(np.diff(a["offsets"]), max_length)
        first = a["first_pairs"]
        keep = np.flatnonzero((first >= 0) & (first + 2 <= n))
        index.append(keep)
        length.append(n[keep])
    counts = [len(k) for k in index]
    return Refs.of(np.repeat(np.asarray(shards, dtype=np.int64), counts), np.concatenate(index or [[]]),
                   np.concatenate(length or [[]]))


def sample_refs(refs: Refs, n: int | None, seed: int) -> Refs:
    """A fixed uniform sample of n refs (all when n is None or not smaller), in store order: the
    held-out samples validation checks on every call."""
    if n is None or n >= len(refs):
        return refs
    return refs[np.sort(np.random.default_rng([seed, 1]).choice(len(refs), n, replace=False))]


Row = tuple[Ref, ...]  # the samples of one row, in row order


@dataclass(frozen=True, eq=False)
class Batches:
    """A list of batches as arrays, read like a list: batches[i] is the i-th batch as a list of Row,
    batches[slice or index array] those batches (the same rows: nothing copied but `order`).
    Batch i holds rows k*batch_size .. k*batch_size+batch_size-1 (those that exist), k = order[i];
    row r the refs at samples[row_starts[r]:row_starts[r + 1]]."""

    refs: Refs
    samples: np.ndarray  # [S] int32 positions in refs, row after row (the epoch's order)
    row_starts: np.ndarray  # [R + 1] int32 where each row begins in samples
    batch_size: int  # rows a batch (the last batch of the rows may hold fewer)
    order: np.ndarray  # [B] int32 the batches, as numbers of batch_size-row blocks

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i):
        if not isinstance(i, (int, np.integer)):
            return dataclasses.replace(self, order=self.order[i])
        lo = int(self.order[i]) * self.batch_size
        bounds = self.row_starts[lo:lo + self.batch_size + 1].tolist()  # the rows' edges in samples
        refs = list(self.refs[self.samples[bounds[0]:bounds[-1]]])
        return [tuple(refs[a - bounds[0]:b - bounds[0]]) for a, b in zip(bounds, bounds[1:])]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __eq__(self, other) -> bool:  # as lists of batches
        return isinstance(other, (Batches, list)) and list(self) == list(other)

    __hash__ = None


def epoch_batches(refs: Refs, batch_size: int, seed: int, epoch: int, rank: int = 0, world: int = 1,
                  batching: str = "bucketed", row_tokens: int | None = None,
                  order: NodeOrder | None = None) -> Batches:
    """This rank's batches of `batch_size` rows for one epoch; every rank gets the same number (the
    tail is dropped). bucketed: one sample a row, rows of similar length batched together (within
    windows of BUCKET batches, a stable sort by length), the batches shuffled; random: one sample a
    row, in the shuffled order; packed: each row takes the next samples of the shuffled order while
    they fit in row_tokens tokens (a sample is never split: Ref.length <= row_tokens). order: the
    node-affine order's layout (node_order.py), None: one global shuffle."""
    key = (batch_size, seed, epoch, batching, row_tokens if batching == "packed" else None, order)
    if key not in refs._last:
        refs._last.clear()
        refs._last[key] = every = _every_batch(refs, *key[:5]) if order is None else _node_batches(refs, *key)
        refs._counts[key] = len(every)
    every = refs._last[key]
    per_rank = len(every) // world
    return every[rank * per_rank:(rank + 1) * per_rank]


def _every_batch(refs: Refs, batch_size: int, seed: int, epoch: int, batching: str, row_tokens: int | None) -> Batches:
    """The epoch's batches before they are dealt (epoch_batches)."""
    g = np.random.default_rng([seed, epoch])
    order = g.permutation(len(refs))  # [N]
    if batching == "bucketed":
        order = _bucket_sorted(order, refs.length, batch_size)
    rows = _rows(refs, order, batching, row_tokens)
    n = -(-(len(rows) - 1) // batch_size)
    batch_order = g.permutation(n) if batching == "bucketed" else np.arange(n, dtype=np.int32)
    return Batches(refs, order.astype(np.int32), rows.astype(np.int32, copy=False), batch_size,
                   batch_order.astype(np.int32, copy=False))


def _node_batches(refs: Refs, batch_size: int, seed: int, epoch: int, batching: str, row_tokens: int | None,
                  order: NodeOrder) -> Batches:
    """The epoch's batches in the node-affine order: each node's samples in its order
    (node_samples), made into rows and full batches as the global order makes them, but bucketed
    batches are shuffled only within their bucket (BUCKET batches), so that a rank's consecutive
    batches stay within a few windows of shards; every node's section trimmed to the same number of
    batches, a multiple of its processes; the sections node after node, so that the contiguous deal
    to the launch's ranks gives node n's ranks node n's section."""
    sections = []
    for mine in node_samples(refs.shard, seed, epoch, order):
        if batching == "bucketed":
            mine = _bucket_sorted(mine, refs.length, batch_size)
        sections.append((mine, _rows(refs, mine, batching, row_tokens)))
    per = min((len(rows) - 1) // batch_size for _, rows in sections) // order.local * order.local
    samples, row_starts, batch_order, at = [], [np.zeros(1, np.int64)], [], 0
    for n, (mine, rows) in enumerate(sections):
        rows = rows[:per * batch_size + 1]  # [per * batch_size + 1]
        samples.append(mine[:rows[-1]])
        row_starts.append(rows[1:] + at)
        at += int(rows[-1])
        in_order = np.arange(per, dtype=np.int64)
        if batching == "bucketed":  # batches shuffled within their bucket
            in_order = shuffled_within(in_order // BUCKET, np.random.default_rng([seed, 4, epoch, n]))
        batch_order.append(n * per + in_order)
    return Batches(refs, np.concatenate(samples).astype(np.int32), np.concatenate(row_starts).astype(np.int32),
                   batch_size, np.concatenate(batch_order).astype(np.int32))


def _bucket_sorted(order: np.ndarray, length: np.ndarray, batch_size: int) -> np.ndarray:
    """order sorted by (window of batch_size * BUCKET samples, length), stably: one int64 key."""
    window = np.arange(len(order), dtype=np.int64) // (batch_size * BUCKET)
    return order[np.argsort((window << 32) | length[order], kind="stable")]


def _rows(refs: Refs, order: np.ndarray, batching: str, row_tokens: int | None) -> np.ndarray:
    """[R + 1] where each row begins in `order`: a row a sample, or packed rows."""
    if batching != "packed":
        return np.arange(len(order) + 1, dtype=np.int32)
    return packed_rows(refs.length[order], row_tokens)


def node_order(config: DataConfig, layout: tuple[int, int]) -> NodeOrder | None:
    """The run's node-affine order for a launch of layout (nodes, processes a node); None: the global order."""
    if config.data_order != "node":
        return None
    return NodeOrder(nodes=layout[0], local=layout[1], window=config.shuffle_window, redeal_every=config.redeal_every)


def train_batches(config: DataConfig, refs: Refs, epoch: int, rank: int = 0, world: int = 1,
                  layout: tuple[int, int] = (1, 1)) -> Batches:
    """This rank's batches of one epoch under the run's --batching (packed rows hold --max-length
    tokens) and --data-order, its nodes and processes a node given by layout (node_order.node_layout)."""
    return epoch_batches(refs, config.batch_size, config.seed, epoch, rank, world, config.batching, config.max_length,
                         node_order(config, layout))


def epoch_length(config: DataConfig, refs: Refs, epoch: int, layout: tuple[int, int] = (1, 1)) -> int:
    """The number of batches of `epoch` in all (train_batches with one rank), without forming them
    unless rows are packed (their count depends on the epoch's order): one row a sample otherwise,
    in the node order the nodes' sample counts (the deal alone)."""
    order = node_order(config, layout)
    if config.batching == "packed":
        key = (config.batch_size, config.seed, epoch, "packed", config.max_length, order)
        return refs._counts[key] if key in refs._counts else len(train_batches(config, refs, epoch, layout=layout))
    if order is not None:  # every node's full batches, as many as the smallest node's, a multiple of its processes
        per = int(node_counts(refs.shard, config.seed, epoch, order).min()) // config.batch_size
        return order.nodes * (per // order.local * order.local)
    return -(-len(refs) // config.batch_size)


def packed_rows(lengths: np.ndarray, row_tokens: int) -> np.ndarray:
    """[N] sample lengths in order -> [R + 1] where each row begins (then N): rows of consecutive
    samples, each as many as fit in row_tokens tokens (at least one). The end of a row begun at
    every sample comes from one search of the running sums; the rows are then walked from the first
    (one Python step a row, through a memoryview: no Python int a sample is made)."""
    ends = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])  # [N + 1]
    nxt = np.searchsorted(ends, ends[:-1] + row_tokens, side="right") - 1  # the row begun at s ends before nxt[s]
    nxt = memoryview(np.maximum(nxt, np.arange(1, len(lengths) + 1, dtype=np.int64)))
    starts, s = array.array("q"), 0
    while s < len(nxt):
        starts.append(s)
        s = nxt[s]
    starts.append(len(nxt))
    return np.frombuffer(starts, dtype=np.int64)


@dataclass
class Batch:
    tokens: torch.Tensor  # [b, T] long, 0 past each length
    loss_mask: torch.Tensor  # [b, T] bool, False past each length
    hidden: torch.Tensor  # [b, T, n_taps, H] bf16, 0 past each length
    lengths: torch.Tensor  # [b] long: tokens of each row
    refs: torch.Tensor  # [D, 2] long: (shard, index) of the D samples, row after row
    starts: torch.Tensor  # [b, T] long: where each token's sample begins in its row (all 0 for one a row)
    corrupt: tuple = ()  # (shard, index, why) of the samples left empty: their read failed (damaged or missing)
    cache_trouble: str | None = None  # why the worker reads without the node cache (--cache-dir), if it does

    def _map(self, fn) -> "Batch":
        values = (getattr(self, f.name) for f in fields(self))
        return Batch(*(fn(v) if isinstance(v, torch.Tensor) else v for v in values))

    def pin_memory(self) -> "Batch":
        return self._map(torch.Tensor.pin_memory)

    def to(self, device) -> "Batch":
        return self._map(lambda t: t.to(device, non_blocking=True))


class StoreBatches(torch.utils.data.Dataset):
    """batches[i], or a batch given whole, -> a padded Batch. Store handles and shard readers open
    lazily, once per worker process, and stay open for as long as the worker lives: the run's
    loader (`loader`) keeps its workers through every epoch, so a shard's reader, its read cache
    (indexes, edge chunks) and its connections are made once per run, not once per epoch."""

    def __init__(self, location: str, batches: Batches | list[list[Row]] = (),
                 node_cache: NodeCache | None = None) -> None:
        """node_cache: a node-local cache of an object store's shard files (--cache-dir), which the
        readers fetch through."""
        self.location, self.batches, self.node_cache = location, batches, node_cache
        self._store: HiddenStore | None = None
        self._readers: dict[int, ShardReader] = {}

    def __len__(self) -> int:
        return len(self.batches)

    def reader(self, shard: int) -> ShardReader:
        if shard not in self._readers:
            try:
                self._readers[shard] = ShardReader(self.store, shard)
            except NotCommitted:  # it was committed when the run indexed it
                raise self._gone(shard) from None
        return self._readers[shard]

    def _gone(self, shard: int) -> StoreCorrupt:
        return StoreCorrupt(f"{self.store.path(layout.commit_key(shard))}: gone since the run started (shard {shard} "
                            "was deleted or cleared under it)", redo_hint(self.location, shard))

    def _why(self, shard: int, e: StoreError) -> StoreError:
        """A failed read's error; a shard deleted whole under a reader kept from an earlier batch
        is named as such (its commit file gone), not by the first of its files found missing."""
        try:
            gone = self.store.commit_record(shard) is None
        except StoreError:  # its commit file damaged now too: the read's own error says enough
            return e
        if gone:
            self._readers.pop(shard, None)
            return self._gone(shard)
        return e

    @property
    def store(self) -> HiddenStore:
        if self._store is None:
            self._store = HiddenStore(self.location, node_cache=self.node_cache)
        return self._store

    def __getitem__(self, key: int | list[Row]) -> Batch:
        """key: the index of a batch in `batches`, or the batch itself (its rows), as the loader
        sends them to its workers."""
        rows = self.batches[key] if isinstance(key, int) else key
        lengths = [sum(r.length for r in row) for row in rows]
        T, b = max(lengths), len(rows)
        states = (len(self.store.attrs.taps), self.store.attrs.hidden_size)
        out = Batch(tokens=torch.zeros(b, T, dtype=torch.long), loss_mask=torch.zeros(b, T, dtype=torch.bool),
                    hidden=torch.zeros(b, T, *states, dtype=torch.bfloat16), lengths=torch.tensor(lengths),
                    refs=torch.tensor([[r.shard, r.index] for row in rows for r in row]),
                    starts=torch.zeros(b, T, dtype=torch.long))
        corrupt, places, items = [], [], []
        for j, row in enumerate(rows):
            at = 0
            for r in row:  # states decoded straight into the batch: no copy per sample
                span = slice(at, at + r.length)
                out.starts[j, span] = at
                at += r.length
                try:
                    items.append((self.reader(r.shard), r.index, r.length, out.hidden[j, span]))
                    places.append((j, span, r))
                except StoreError as e:
                    corrupt.append((r.shard, r.index, str(e)))
                    out.lengths[j] -= r.length
        for (j, span, r), s in zip(places, read_samples(items)):  # the batch's requests in flight together
            if isinstance(s, StoreError):  # damaged, or deleted under the run: its span stays empty (no tokens,
                # no loss, seen by no other sample), and the main process decides
                out.hidden[j, span] = 0
                out.lengths[j] -= r.length
                corrupt.append((r.shard, r.index, str(self._why(r.shard, s))))
            elif isinstance(s, Exception):
                raise s
            else:
                out.tokens[j, span], out.loss_mask[j, span] = s.tokens, s.loss_mask
        out.corrupt = tuple(corrupt)
        out.cache_trouble = None if self.node_cache is None else self.node_cache.trouble
        return out


def loader(config: DataConfig, batches: Iterable[list[Row]], pin: bool, skipped: set, warn=None):
    """Batches read and padded by --workers worker processes, in order. `batches` may be endless
    (every epoch's, formed as they are reached): its batches go to the workers as they are taken,
    and the workers live as long as this loader. A sample whose read failed (damaged or missing)
    stops the run (--on-corrupt stop: one line naming the file and the fix) or is left out of its
    batch and added to `skipped` (skip). A node cache that cannot be written is said once (to warn)."""
    dataset = StoreBatches(config.store, node_cache=node_cache_of(config))
    workers = torch.utils.data.DataLoader(dataset, sampler=batches, batch_size=None, num_workers=config.workers,
                                          pin_memory=pin, prefetch_factor=PREFETCH if config.workers else None,
                                          worker_init_fn=quiet_inherited_sessions)
    said = False
    for batch in workers:
        if batch.cache_trouble and warn is not None and not said:
            warn(f"warning: {batch.cache_trouble}")
            said = True
        for shard, index, why in batch.corrupt:
            if config.on_corrupt == "stop":
                raise StoreCorrupt(why)
            skipped.add((shard, index))
        yield batch


def quiet_inherited_sessions(_worker: int) -> None:
    """In a forked loader worker: do not report the parent's HTTP sessions as unclosed. An object
    store's file system (s3fs) holds an aiohttp session bound to the parent's event loop; the fork
    copies it, nothing here can close it (the parent does, at its exit), and when the worker's
    garbage collector frees the copy aiohttp printed "Unclosed client session" at every loader
    start. The worker's own sessions end with the process."""
    logging.getLogger("asyncio").addFilter(
        lambda r: not str(r.msg).startswith(("Unclosed client session", "Unclosed connector")))


def shared_memory_need(config: DataConfig, refs: Refs, n_taps: int, hidden_size: int, local_processes: int) -> int:
    """Bytes of shared memory the loader workers of one node's `local_processes` training
    processes may hold at once: each worker's PREFETCH batches of bf16 states, rows as long as
    the longest sample (packed rows: --max-length)."""
    if not config.workers or not refs:
        return 0
    row = config.max_length if config.batching == "packed" else int(refs.length.max())
    batch = config.batch_size * row * n_taps * hidden_size * 2  # hidden: [b, T, n_taps, H] bf16
    return local_processes * config.workers * PREFETCH * batch


def check_shared_memory(config: DataConfig, need: int, path: str = SHM) -> None:
    """Refuse up front, in one line, a run whose loader workers would run out of shared memory at
    the first batches (a container's default /dev/shm is 64 MB); no check where there is none."""
    if not need or not os.path.isdir(path):
        return
    free = shutil.disk_usage(path).free
    if need > free:
        gib = math.ceil(need / 2**30)
        raise ConfigError("--workers", config.workers,
                          f"the loader workers on this node may hold {need / 2**30:.1f} GiB of batches in {path}, "
                          f"which has {free / 2**30:.1f} GiB free; give it more (docker run --shm-size={gib + 1}g, "
                          "or a larger tmpfs) or use --workers 0 (read in the training process)")
