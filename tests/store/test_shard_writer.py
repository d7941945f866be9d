"""The shard writer: states round-trip bit for bit, host memory held is bounded in bytes, a failed
write surfaces in the model thread and nothing is committed."""

import time

import pytest
import torch

from store.format import hidden_formats, layout
from store.shard_reader import ShardReader
from store.shard_writer import ShardWriter
from store.store_writer import StoreWriter

TAPS, H = 2, 16
TOKEN_BYTES = TAPS * H * 2


def fresh_store(tmp_path, small_store) -> StoreWriter:
    import shutil

    path = tmp_path / "copy.zarr"
    shutil.copytree(small_store, path)
    return StoreWriter(str(path))


def made_in(request, hidden_format: str):
    """The path of the small store extracted in hidden_format (the session's fixture)."""
    return request.getfixturevalue({"bf16": "small_store", "fp8": "fp8_store"}[hidden_format])


def batches(n: int, tokens: int = 20, hidden_format: str = "bf16"):
    """n batches of states; rounded as the capture rounds them in hidden_format (what its writer is given)."""
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(tokens, TAPS, H, generator=g).to(torch.bfloat16) for _ in range(n)]
    return [hidden_formats.of(hidden_format).round(p) for p in parts]


def write(writer: ShardWriter, parts: list[torch.Tensor]) -> None:
    for i, h in enumerate(parts):
        writer.add(i, [1] * 5, [2] * (len(h) - 5), truncated=False)
        writer.add_hidden(h)


@pytest.mark.parametrize("hidden_format", hidden_formats.NAMES)
def test_states_round_trip_bit_for_bit(tmp_path, request, hidden_format):
    """bf16: what the target gave; fp8: what the capture rounded, both bit for bit (the direct reader
    of the shipped layouts; the rounding error itself is tests/store/format/test_fp8_codec.py's)."""
    store = fresh_store(tmp_path, made_in(request, hidden_format))
    parts = batches(7, hidden_format=hidden_format)
    writer = ShardWriter(store, 1, TAPS, H, chunk_tokens=8, shard_tokens=32)
    write(writer, parts)
    record = writer.commit(None, run={})
    assert record.tokens == 140 and record.shapes["hidden"] == [140, TAPS, H]
    assert record.checksums["hidden"] == layout.crc32(layout.to_bits(torch.cat(parts)))
    reader = ShardReader(store, 1)
    assert reader._direct is not None
    for i, h in enumerate(parts):
        assert torch.equal(reader[i].hidden, h)


def test_an_fp8_writer_refuses_states_that_were_not_rounded(tmp_path, fp8_store):
    store = fresh_store(tmp_path, fp8_store)
    writer = ShardWriter(store, 1, TAPS, H, chunk_tokens=8, shard_tokens=32)
    with pytest.raises(RuntimeError, match="quantize them first"):
        write(writer, batches(7))
        writer.commit(None, run={})
    writer.abort()
    assert store.commit_record(1) is None


def test_held_states_stay_within_the_byte_bound(tmp_path, small_store, monkeypatch):
    """Held: the bytes of states handed over less those of the shard files written (8 tokens each),
    counted as each add_hidden returns; the writer counts a file as written only after it is, so
    this never exceeds what it holds."""
    store = fresh_store(tmp_path, small_store)
    real_write = StoreWriter.write_pieces
    files = []

    def slow_write(self, key, pieces):  # a disk slower than the model
        time.sleep(0.05)
        real_write(self, key, pieces)
        files.append(key)

    monkeypatch.setattr(StoreWriter, "write_pieces", slow_write)
    limit = 50 * TOKEN_BYTES  # two and a half batches of 20 tokens
    writer = ShardWriter(store, 1, TAPS, H, chunk_tokens=4, shard_tokens=8, max_held_bytes=limit)
    seen, handed = [], 0
    for i, h in enumerate(batches(12)):
        writer.add(i, [1] * 5, [2] * 15, truncated=False)
        writer.add_hidden(h)
        handed += h.numel() * 2
        seen.append(handed - 8 * TOKEN_BYTES * sum("/hidden/" in k for k in files))
    writer.commit(None, run={})
    assert max(seen) <= limit and max(seen) > 20 * TOKEN_BYTES  # bounded, and the bound was reached
    assert writer.stall_s > 0  # the model thread waited for the writer


def test_a_failed_write_surfaces_and_nothing_is_committed(tmp_path, small_store, monkeypatch):
    store = fresh_store(tmp_path, small_store)

    def broken_write(self, key, pieces):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(StoreWriter, "write_pieces", broken_write)
    writer = ShardWriter(store, 1, TAPS, H, chunk_tokens=4, shard_tokens=8, max_held_bytes=30 * TOKEN_BYTES)
    with pytest.raises(RuntimeError, match="No space left on device"):
        write(writer, batches(20))
        writer.commit(None, run={})
    writer.abort()
    assert store.commit_record(1) is None


@pytest.mark.parametrize("threads,hidden_format", [(1, "bf16"), (3, "bf16"), (2, "fp8")])
def test_whole_shard_files_are_byte_for_byte_what_zarr_writes(tmp_path, request, threads, hidden_format):
    """The writer encodes whole shard files itself (store/format/shard_file.py); each file holds exactly
    the bytes zarr's own sharding codec writes for the same states, and the partial last one goes
    through zarr."""
    import numpy as np
    import zarr

    store = fresh_store(tmp_path, made_in(request, hidden_format))
    parts = batches(9, tokens=23, hidden_format=hidden_format)  # 207 tokens: 6 whole shard files of 32, a partial one
    writer = ShardWriter(store, 1, TAPS, H, chunk_tokens=8, shard_tokens=32, threads=threads)
    write(writer, parts)
    writer.commit(None, run={})
    bits = layout.to_bits(torch.cat(parts))
    ref = zarr.create_array(
        str(tmp_path / "ref.zarr"),
        shape=bits.shape,
        dtype=np.uint16,
        chunks=(8, TAPS, H),
        shards=(32, TAPS, H),
        compressors=hidden_formats.of(hidden_format).codecs(1, H),
        fill_value=0,
        chunk_key_encoding=layout.chunk_key_encoding(),
    )
    ref[:] = bits
    ours = tmp_path / "copy.zarr" / "shards" / "00001" / "hidden"
    files = sorted(p.name for p in ours.glob("c.*"))
    assert len(files) == 7 and files == sorted(p.name for p in (tmp_path / "ref.zarr").glob("c.*"))
    for f in files:
        assert (ours / f).read_bytes() == (tmp_path / "ref.zarr" / f).read_bytes(), f
    assert np.array_equal(store.shard_arrays(1)["hidden"][:], bits)


def test_a_bound_smaller_than_a_shard_file_never_deadlocks(tmp_path, small_store):
    """With room for less than one shard file, the writer waits for batches to fill it while the
    model would wait for room: the model thread goes on once the writer has taken everything."""
    import threading

    store = fresh_store(tmp_path, small_store)
    writer = ShardWriter(store, 1, TAPS, H, chunk_tokens=8, shard_tokens=64, max_held_bytes=30 * TOKEN_BYTES)
    done = threading.Event()
    worker = threading.Thread(
        target=lambda: (write(writer, batches(10)), writer.commit(None, run={}), done.set()), daemon=True
    )
    worker.start()
    worker.join(timeout=60)
    assert done.is_set() and store.commit_record(1).tokens == 200


@pytest.mark.parametrize("threads", [1, 3])
def test_final_states_are_written_beside_the_taps_and_read_back_bit_for_bit(tmp_path, final_store, threads):
    """A store that keeps the final state: the writer takes [t, H] per batch with the taps, cuts, encodes
    and writes it as `hidden` (whole files byte for byte what zarr writes, the partial last through
    zarr); it reads back bit for bit through the direct reader and through zarr, and counts in the
    held bytes."""
    import numpy as np
    import zarr

    store = fresh_store(tmp_path, final_store)
    parts = batches(9, tokens=23)
    g = torch.Generator().manual_seed(1)
    finals = [torch.randn(len(p), H, generator=g).to(torch.bfloat16) for p in parts]
    writer = ShardWriter(store, 1, TAPS, H, chunk_tokens=8, shard_tokens=32, threads=threads)
    assert writer._token_bytes == (TAPS + 1) * H * 2
    for i, (h, f) in enumerate(zip(parts, finals)):
        writer.add(i, [1] * 5, [2] * (len(h) - 5), truncated=False)
        writer.add_hidden(h, f)
    writer.check_final({"matches": 3, "tokens": 4, "normed": 5, "states": 5})
    writer.check_final({"matches": 1, "tokens": 1, "normed": 2, "states": 2})
    record = writer.commit(None, run={})
    bits = layout.to_bits(torch.cat(finals))
    assert record.shapes[layout.FINAL_STATE] == [207, H] and record.checksums[layout.FINAL_STATE] == layout.crc32(bits)
    assert record.final_state == {"matches": 4, "tokens": 5, "normed": 7, "states": 7}
    ref = zarr.create_array(
        str(tmp_path / "ref.zarr"),
        shape=bits.shape,
        dtype=np.uint16,
        chunks=(8, H),
        shards=(32, H),
        compressors=hidden_formats.BF16.codecs(1, H),
        fill_value=0,
        chunk_key_encoding=layout.chunk_key_encoding(),
    )
    ref[:] = bits
    ours = tmp_path / "copy.zarr" / "shards" / "00001" / layout.FINAL_STATE
    files = sorted(p.name for p in ours.glob("c.*"))
    assert len(files) == 7 and files == sorted(p.name for p in (tmp_path / "ref.zarr").glob("c.*"))
    for f in files[:-1]:  # the whole files, which the writer encodes itself
        assert (ours / f).read_bytes() == (tmp_path / "ref.zarr" / f).read_bytes(), f
    reader = ShardReader(store, 1)
    assert reader._final[0] is not None  # read straight from the chunk files
    for i, (h, f) in enumerate(zip(parts, finals)):
        s = reader.read(i, final_state=True)
        assert torch.equal(s.hidden, h) and torch.equal(s.final_state, f)
    assert torch.equal(layout.from_bits(reader._final[1][23:46]), finals[1])  # and through zarr


def test_a_writer_takes_final_states_exactly_when_its_store_keeps_them(tmp_path, small_store, final_store):
    plain = ShardWriter(fresh_store(tmp_path / "a", small_store), 1, TAPS, H, chunk_tokens=8, shard_tokens=32)
    with pytest.raises(AssertionError):
        plain.add_hidden(batches(1)[0], torch.zeros(20, H, dtype=torch.bfloat16))
    plain.abort()
    final = ShardWriter(fresh_store(tmp_path / "b", final_store), 1, TAPS, H, chunk_tokens=8, shard_tokens=32)
    with pytest.raises(AssertionError):
        final.add_hidden(batches(1)[0])
    final.abort()
