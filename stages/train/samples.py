"""Sample refs: which samples of the chosen shards training reads, straight from the store.

`index_samples` lists the trainable samples of the chosen shards (lengths only, no hidden
states) as `Refs`: three parallel int32 arrays, 12 bytes a sample, formed with numpy, no Python
object a sample (a `Ref` is made only when a batch is read), by every rank alike from the
per-sample arrays the main process read and sent (`refs_of`; stages/train/setup.py): at 2.5M
samples a rank forms its refs in well under a second and holds 12 bytes a sample of them
(docs/performance.md). `sample_refs` is the fixed sample of the held-out refs validation checks.
An epoch's order of the refs is formed in epoch_order.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from store.format.schema import ShardCommit
from store.hidden_store import HiddenStore
from store.sample_index import per_sample


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
        assert all(a.dtype == np.int32 and a.shape == self.length.shape for a in self._arrays()), (
            "Refs: three int32 arrays of one length"
        )

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


def index_samples(
    store: HiddenStore, shards: list[int], max_length: int, records: dict[int, ShardCommit] | None = None
) -> Refs:
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
    return Refs.of(
        np.repeat(np.asarray(shards, dtype=np.int64), counts),
        np.concatenate(index or [[]]),
        np.concatenate(length or [[]]),
    )


def sample_refs(refs: Refs, n: int | None, seed: int) -> Refs:
    """A fixed uniform sample of n refs (all when n is None or not smaller), in store order: the
    held-out samples validation checks on every call."""
    if n is None or n >= len(refs):
        return refs
    return refs[np.sort(np.random.default_rng([seed, 1]).choice(len(refs), n, replace=False))]
