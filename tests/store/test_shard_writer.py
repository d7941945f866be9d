"""The shard writer: states round-trip bit for bit, host memory held is bounded in bytes, a failed
write surfaces in the model thread and nothing is committed."""

import time

import pytest
import torch

from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader
from store.shard_writer import ShardWriter

TAPS, H = 2, 16
TOKEN_BYTES = TAPS * H * 2


def fresh_store(tmp_path, small_store) -> HiddenStore:
    import shutil

    path = tmp_path / "copy.zarr"
    shutil.copytree(small_store, path)
    return HiddenStore(str(path))


def batches(n: int, tokens: int = 20):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(tokens, TAPS, H, generator=g).to(torch.bfloat16) for _ in range(n)]


def write(writer: ShardWriter, parts: list[torch.Tensor]) -> None:
    for i, h in enumerate(parts):
        writer.add(i, [1] * 5, [2] * (len(h) - 5), truncated=False)
        writer.add_hidden(h)


def test_states_round_trip_bit_for_bit(tmp_path, small_store):
    store = fresh_store(tmp_path, small_store)
    parts = batches(7)
    writer = ShardWriter(store, 1, TAPS, H, chunk_tokens=8, shard_tokens=32)
    write(writer, parts)
    record = writer.commit(None, run={})
    assert record.tokens == 140 and record.shapes["hidden"] == [140, TAPS, H]
    reader = ShardReader(store, 1)
    for i, h in enumerate(parts):
        assert torch.equal(reader[i].hidden, h)


def test_held_states_stay_within_the_byte_bound(tmp_path, small_store, monkeypatch):
    store = fresh_store(tmp_path, small_store)
    real_flush = ShardWriter._flush

    def slow_flush(self, final):  # a disk slower than the model
        time.sleep(0.05)
        real_flush(self, final)

    monkeypatch.setattr(ShardWriter, "_flush", slow_flush)
    limit = 50 * TOKEN_BYTES  # two and a half batches of 20 tokens
    writer = ShardWriter(store, 1, TAPS, H, chunk_tokens=4, shard_tokens=8, max_held_bytes=limit)
    seen = []
    for i, h in enumerate(batches(12)):
        writer.add(i, [1] * 5, [2] * 15, truncated=False)
        writer.add_hidden(h)
        seen.append(writer.held_bytes)
    writer.commit(None, run={})
    assert max(seen) <= limit and max(seen) > 20 * TOKEN_BYTES  # bounded, and the bound was reached
    assert writer.stall_s > 0  # the model thread waited for the writer


def test_a_failed_write_surfaces_and_nothing_is_committed(tmp_path, small_store, monkeypatch):
    store = fresh_store(tmp_path, small_store)

    def broken_flush(self, final):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ShardWriter, "_flush", broken_flush)
    writer = ShardWriter(store, 1, TAPS, H, chunk_tokens=4, shard_tokens=8, max_held_bytes=30 * TOKEN_BYTES)
    with pytest.raises(RuntimeError, match="No space left on device"):
        write(writer, batches(20))
        writer.commit(None, run={})
    writer.abort()
    assert store.commit_record(1) is None
