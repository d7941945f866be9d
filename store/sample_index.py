"""The per-sample arrays (offsets, first_pairs, ...) of many committed shards, read in one batch.

A training run's start-up needs, of every shard, only its small per-sample arrays. Through zarr
that costs five round trips a shard (about 8 ms each shard here, 20 s at 2,442 shards; a request
each on an object store). For the layout schema 2 writes them in (one chunk: little-endian
values, blosc, then crc32c; store/format/layout.py `small_codecs`) every shard's metadata and chunk
files are fetched in one `fs.cat` (concurrent requests on an object store) and decoded by
store/format/per_sample_array.py.
Every file is checked: each metadata file against the CRC-32 its commit file records, each chunk
against its crc32c, each array against the commit file's checksum and shape. A shard that is not
exactly that layout, or fails any check, is read again by ShardReader, which reads old layouts
and names the damage with its fix; so nothing wrong is ever returned from here.
"""

from __future__ import annotations

import numpy as np

from store.format import layout, per_sample_array
from store.format.read_checks import first_chunk
from store.format.schema import ShardCommit
from store.hidden_store import HiddenStore
from store.io import commit_file
from store.shard_reader import ShardReader


def per_sample(
    store: HiddenStore, records: dict[int, ShardCommit], names: tuple[str, ...] = ("offsets", "first_pairs")
) -> dict[int, dict[str, np.ndarray]]:
    """shard -> {name: its array}, for every shard of records (its commit record), in one batch
    of reads; shards another layout or a failed check leaves out are read by ShardReader."""
    direct = store.read_checks(records).direct_reads  # else every shard goes through ShardReader (zarr)
    keys = {
        (s, n, f): store.path(f"{layout.shard_group(s)}/{n}/{f}")
        for s, rec in records.items()
        for n in names
        if direct and n in rec.shapes
        for f in ("zarr.json", first_chunk(rec))
    }
    blobs = commit_file.cat_many(store.fs, list(keys.values()))
    got = dict(zip(keys, blobs))
    out = {}
    for s, rec in records.items():
        try:
            out[s] = {
                n: per_sample_array.decoded(rec, n, got.get((s, n, "zarr.json")), got.get((s, n, first_chunk(rec))))
                for n in names
            }
        except per_sample_array.NotDirect:
            reader = ShardReader(store, s, rec)
            out[s] = {n: getattr(reader, n) for n in names}
    return out
