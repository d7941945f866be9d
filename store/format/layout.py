"""Names, codecs and dtypes of the hidden-state store (documented in docs/store.md).

    STORE/
      zarr.json                    root group; attributes = provenance (store/format/schema.py)
      target/embed_tokens          [V, H] uint16 (bf16 bits), the target's input embedding
      target/lm_head               [V, H] uint16 (bf16 bits), the target's output projection
      shards/00003/hidden          [T, n_taps, H] uint16 (bf16 bits), chunked along tokens; its hidden format's codec
      shards/00003/tokens          [T] int32     prompt + completion ids of every sample
      shards/00003/loss_mask       [T] uint8     1 exactly on completion tokens
      shards/00003/offsets         [N+1] int64   sample i is tokens offsets[i]:offsets[i+1]
      shards/00003/prompt_lens     [N] int32     prompt tokens at the start of each sample
      shards/00003/row_ids         [N] int64     dataset row of each sample
      shards/00003/first_pairs     [N] int32     first position with loss on it and the next (-1: none)
      shards/00003/final_state     [T, H] uint16 (bf16 bits), the target's state after its final norm
                                   (only in stores made with --final-state); coded as `hidden` is
      _commits/root.json           written last when the root is complete
      _commits/00003.json          written last when shard 3 is complete: stats + checksums
      _locks/00003.lock            held while a process writes shard 3
      _index/samples-<state>.npz   a cache of the commit records and per-sample index (store/index_file.py)

A shard without its commit file is not part of the store, whatever its arrays hold.

Each array's chunks are files named by zarr's chunk key encoding, which its metadata records: from
format revision 5 "c.K.0.0" (`CHUNK_SEPARATOR`), a file beside the array's zarr.json; before, zarr's
default "c/K/0/0", a directory per key level (two thirds of a shard's inodes). Readers follow the
metadata, or, before they hold it, the shard's commit record (`chunk_key`).
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import numpy as np
from zarr.codecs import BloscCodec, BloscShuffle, Crc32cCodec

from store.format.bf16_codec import Bf16Planes
from store.format.chunk_codec import LEVELS as PLANE_LEVELS

if TYPE_CHECKING:
    import torch

HIDDEN_DTYPE = "bfloat16"  # what the uint16 bits mean
SHARD_ARRAYS = ("hidden", "tokens", "loss_mask", "offsets", "prompt_lens", "row_ids")
# Per-sample arrays added in schema 2 (absent from schema-1 shards): first_pairs[i] is the first
# position of sample i whose token and the next both carry the loss (-1: none), so an index of
# samples is built from O(samples) bytes, never the per-token mask.
INDEX_ARRAYS = ("first_pairs",)
# The optional per-token state array (compat.final_state): one state per token, chunked, sharded and coded
# as `hidden` is (its hidden format), a state array of width H instead of n_taps x H.
FINAL_STATE = "final_state"
STATE_ARRAYS = ("hidden", FINAL_STATE)
ARRAY_DTYPES = {
    "hidden": np.uint16,
    FINAL_STATE: np.uint16,
    "tokens": np.int32,
    "loss_mask": np.uint8,
    "offsets": np.int64,
    "prompt_lens": np.int32,
    "row_ids": np.int64,
    "first_pairs": np.int32,
}
TOKEN_CHUNK = 1 << 16  # elements per chunk of the per-token arrays: a sample's span decodes little
SKIP_REASONS = ("empty_prompt", "prompt_too_long", "missing_response", "server_rejected", "nonfinite")
# A store's states come in one hidden format, fixed when it is created, each with its codec, each chunk
# ending in a crc32c that every read verifies: store/format/hidden_formats.py. Older stores may hold "blosc"
# (blosc zstd, byte shuffle, no checksum; schema 1 and the retired `--codec blosc`), which zarr reads;
# store/format/read_checks.py says what each layout allows.
DEFAULT_LEVEL = 1
LEVELS = PLANE_LEVELS
CHUNK_SEPARATOR = "."  # what revision 5 on writes between a chunk key's parts (earlier: "/")
OLD_SEPARATOR = "/"


def chunk_key_encoding(separator: str = CHUNK_SEPARATOR) -> dict:
    """The zarr-3 chunk key encoding of every array the store writes."""
    return {"name": "default", "separator": separator}


def chunk_key(separator: str, *coords: int) -> str:
    """The key of a chunk (at coords) under an array, as zarr's default encoding names it."""
    return separator.join(["c", *map(str, coords)])


def shard_name(shard: int) -> str:
    return f"{shard:05d}"


def shard_group(shard: int) -> str:
    return f"shards/{shard_name(shard)}"


def commit_key(shard: int | str) -> str:
    return f"_commits/{shard if isinstance(shard, str) else shard_name(shard)}.json"


def hidden_codecs(level: int) -> list:
    """The codec chain of bf16 bits (the embedding, lm_head; a bf16 store's states); lossless."""
    return [Bf16Planes.for_states(level, 0), Crc32cCodec()]


def first_pairs(loss_mask: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per sample, the first position p (from the sample's start) with loss_mask[p] and
    loss_mask[p + 1], or -1."""
    pair = np.flatnonzero(loss_mask[:-1].astype(bool) & loss_mask[1:].astype(bool))
    out = np.full(len(offsets) - 1, -1, dtype=np.int32)
    if len(pair):
        k = np.searchsorted(pair, offsets[:-1])  # each sample's first pair at or after its start
        ok = k < len(pair)
        first = np.where(ok, pair[np.minimum(k, len(pair) - 1)], 0)
        inside = ok & (first + 1 < offsets[1:])  # the pair ends inside the sample
        out[inside] = (first - offsets[:-1])[inside]
    return out


def small_codecs() -> list:
    """The codec chain of the per-token and per-sample integer arrays."""
    return [BloscCodec(cname="zstd", clevel=3, shuffle=BloscShuffle.shuffle), Crc32cCodec()]


def to_bits(x: torch.Tensor) -> np.ndarray:
    """bf16 tensor -> uint16 numpy array of the same bits (zarr has no bfloat16)."""
    import torch  # here, not at the top: the store's read view opens without torch (docs/reliability.md)

    assert x.dtype == torch.bfloat16, x.dtype
    return x.contiguous().view(torch.int16).numpy().view(np.uint16)


def from_bits(a: np.ndarray) -> torch.Tensor:
    """uint16 numpy array -> bf16 tensor of the same bits; exact inverse of to_bits."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)


def crc32(a: np.ndarray, running: int = 0) -> int:
    """CRC-32 of an array's C-order bytes (the checksum in commit files), continuing `running`."""
    return zlib.crc32(memoryview(np.ascontiguousarray(a)).cast("B"), running)
