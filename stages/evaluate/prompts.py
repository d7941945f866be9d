"""The stored prompts evaluation replays: every sample with a completion in the chosen shards, or a
fixed random sample of them (seeded, the same on every process), dealt to processes, and read
ahead by a few threads in order (a store's held-out shards may not fit in memory).

Which prompts there are comes from the store's index (store/index_file.py: every committed shard's
commit record, offsets and prompt lengths in one file), so a shard is opened only when one of its
sampled prompts is read: on an object store with thousands of shards, start-up costs the index
file, not a few requests a shard, and the reads of a part overlap instead of waiting in turn."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from store import index_file
from store.format.schema import ShardCommit
from store.hidden_store import HiddenStore
from store.index_file import StoreIndex
from store.sample_index import per_sample
from store.shard_reader import Sample, ShardReader

Ref = tuple[int, int]  # (shard, index within the shard)
READ_THREADS = 8  # reads in flight per process: enough to hide an object store's ~50 ms a request


class Prompts:
    def __init__(
        self, store: HiddenStore, shards: list[int], limit: int | None, seed: int, index: StoreIndex | None = None
    ) -> None:
        """index: the store's index when the caller has read it (index_file.load); else read here."""
        self.store = store
        self.records, arrays = _shard_arrays(store, shards, index if index is not None else index_file.load(store)[0])
        refs, lengths = [], []
        for shard in shards:  # a completion follows every prompt (pipeline verify checks it)
            n = np.diff(arrays[shard]["offsets"])
            keep = np.flatnonzero(n > arrays[shard]["prompt_lens"])
            refs.append(np.stack([np.full(len(keep), shard), keep], axis=1))
            lengths.append(n[keep])
        refs_a = np.concatenate(refs) if refs else np.zeros((0, 2), np.int64)
        lengths_a = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        self.available = len(refs_a)
        pick = np.arange(len(refs_a))
        if limit is not None and limit < len(refs_a):
            pick = np.sort(np.random.default_rng(seed).choice(len(refs_a), limit, replace=False))
        self.refs: list[Ref] = [(int(s), int(i)) for s, i in refs_a[pick]]  # in store order
        self.max_length = int(lengths_a[pick].max()) if len(pick) else 0
        # each replayed prompt's label (--category-field at extraction), when its shard has them
        self.category = {
            (s, i): self.records[s].category(i) for s, i in self.refs if self.records[s].categories is not None
        }

    def __len__(self) -> int:
        return len(self.refs)

    def part(self, rank: int, world: int) -> list[Ref]:
        """This process's prompts: every world-th, from its rank."""
        return self.refs[rank::world]

    def texts(self, refs: list[Ref]) -> list[tuple[np.ndarray, int]]:
        """Per ref, (its stored tokens [T] int32: prompt then completion, prompt length); no states
        read. Arrays, not lists: 4 bytes a token, not ~36 (all of a 2.5M-sample store's held-out part
        would otherwise take tens of GB)."""
        return [(reader.tokens(i), int(reader.prompt_lens[i])) for reader, i in self._walk(refs)]

    def _walk(self, refs: list[Ref]) -> Iterator[tuple[ShardReader, int]]:
        """(the reader of its shard, its index) per ref; refs in store order, so one shard's handles
        are open at a time."""
        reader: ShardReader | None = None
        for shard, i in refs:
            if reader is None or reader.shard != shard:
                reader = ShardReader(self.store, shard, self.records[shard])
            yield reader, i

    def read(
        self, refs: list[Ref], ahead: int = 8, threads: int = READ_THREADS, final_state: bool = False
    ) -> Iterator[Sample]:
        """The samples of refs, in order, read by `threads` threads up to `ahead` samples early (at
        least one a thread). Each thread keeps a reader of the last shard it read (one reader per
        thread: ShardReader reuses its decoding buffers). final_state: with their final states."""
        local = threading.local()

        def one(ref: Ref) -> Sample:
            shard, i = ref
            reader = getattr(local, "reader", None)
            if reader is None or reader.shard != shard:
                reader = local.reader = ShardReader(self.store, shard, self.records[shard])
            return reader.read(i, final_state=final_state)

        pending: queue.Queue[Future | None] = queue.Queue(maxsize=max(ahead, threads))
        stop = threading.Event()
        pool = ThreadPoolExecutor(threads, thread_name_prefix="prompt-reader")

        def submit() -> None:  # in order, never more than `ahead` waiting to be taken
            for ref in refs:
                future = pool.submit(one, ref)
                while not stop.is_set():
                    try:
                        pending.put(future, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            pending.put(None)

        feeder = threading.Thread(target=submit, daemon=True, name="prompt-feeder")
        feeder.start()
        try:
            while (future := pending.get()) is not None:
                yield future.result()  # a failed read raises here, in the consuming thread
        finally:
            stop.set()
            pool.shutdown(wait=False, cancel_futures=True)


def _shard_arrays(
    store: HiddenStore, shards: list[int], index: StoreIndex
) -> tuple[dict[int, ShardCommit], dict[int, dict[str, np.ndarray]]]:
    """(commit record, {offsets, prompt_lens}) of each of shards: from the index, and for a shard
    committed after it was made, from the shard's own files."""
    records = {s: index.records[s] for s in shards if s in index.records}
    arrays = {s: index.arrays[s] for s in records}
    later = {s: store.commit_record(s) for s in shards if s not in records}  # choose_shards checked they exist
    if later:
        records.update(later)
        arrays.update(per_sample(store, later, ("offsets", "prompt_lens")))
    return records, arrays
