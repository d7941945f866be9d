"""Spans read straight from chunk files: equal to zarr's reads everywhere (chunk and shard-file
edges, the partial last shard file, chunks zarr never wrote), damage detected, other layouts left
to zarr."""

import numpy as np
import pytest
import torch
import zarr

from store import span_reader
from store.errors import StoreCorrupt
from store.format import hidden_formats, layout
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader, read_samples
from store.shard_writer import ShardWriter
from tests.store.test_shard_writer import TAPS, H, batches, fresh_store, made_in, write

ARRAYS = ("hidden", "tokens", "loss_mask")


def written(tmp_path, request, hidden_format: str = "bf16") -> HiddenStore:
    """Shard 1: 207 tokens in shard files of 32 (chunks of 8): six whole files written by the
    writer, a partial seventh by zarr, whose first chunk is all zeros (written all the same)."""
    store = fresh_store(tmp_path, made_in(request, hidden_format))
    parts = batches(9, tokens=23, hidden_format=hidden_format)
    parts[-1][8:16] = 0  # tokens 192-199: the partial file's first chunk
    writer = ShardWriter(store, 1, TAPS, H, chunk_tokens=8, shard_tokens=32)
    write(writer, parts)
    writer.commit(None, run={})
    return store


def readers(store: HiddenStore, missing_is_damage: bool = True) -> dict:
    group = store.shard_arrays(1)
    return {
        name: (
            span_reader.for_array(store.fs, store.path(f"shards/00001/{name}"), group[name], missing_is_damage),
            group[name],
        )
        for name in ARRAYS
    }


def partial_file_index(tmp_path) -> np.ndarray:
    """[4, 2] (offset, length) of the partial shard file's chunks."""
    path = tmp_path / "copy.zarr" / "shards" / "00001" / "hidden" / "c.6.0.0"
    return np.frombuffer(path.read_bytes()[-(16 * 4 + 4) : -4], "<u8").reshape(4, 2)


def assert_spans_equal_zarr(store: HiddenStore, missing_is_damage: bool) -> None:
    rng = np.random.default_rng(0)
    spans = [(0, 207), (0, 0), (206, 207), (7, 9), (31, 33), (190, 201), (192, 200)]
    spans += [tuple(sorted(rng.integers(0, 208, 2).tolist())) for _ in range(60)]
    for name, (direct, array) in readers(store, missing_is_damage).items():
        assert direct is not None, name
        whole = array[:]
        for a, b in spans:
            got = direct.read(a, b)
            assert got.dtype == whole.dtype and np.array_equal(got, whole[a:b]), (name, a, b)


@pytest.mark.parametrize("hidden_format", hidden_formats.NAMES)
def test_every_span_equals_what_zarr_reads(tmp_path, request, hidden_format):
    store = written(tmp_path, request, hidden_format)
    index = partial_file_index(tmp_path)
    assert index[0, 0] != 2**64 - 1 and index[1, 0] != 2**64 - 1  # the zero chunk is written too
    assert store.commit_record(1).every_chunk
    assert_spans_equal_zarr(store, missing_is_damage=True)
    with pytest.raises(IndexError):
        readers(store)["hidden"][0].read(200, 208)


def test_chunks_zarr_left_out_read_as_zeros_in_older_stores_and_as_damage_in_new_ones(tmp_path, request):
    """Before `every_chunk`, zarr left all-zero chunks out: a missing chunk then reads as zeros."""
    store = written(tmp_path, request)
    hidden = zarr.open_array(store.path("shards/00001/hidden"), mode="r+")  # zarr's default: skip fill chunks
    hidden[192:207] = hidden[192:207]
    index = partial_file_index(tmp_path)
    assert index[0, 0] == 2**64 - 1 and index[1, 0] != 2**64 - 1  # zarr left the zero chunk out
    assert_spans_equal_zarr(store, missing_is_damage=False)
    with pytest.raises(StoreCorrupt, match="c.6.0.0, chunk 0 is missing"):
        readers(store)["hidden"][0].read(190, 201)


def test_extracted_stores_are_read_directly_and_samples_match(store_copy):
    store = HiddenStore(str(store_copy))
    for shard in store.committed():
        reader = ShardReader(store, shard)
        assert reader._direct is not None
        group = store.shard_arrays(shard)
        for i in range(len(reader)):
            a, b = int(reader.offsets[i]), int(reader.offsets[i + 1])
            s = reader[i]
            assert np.array_equal(layout.to_bits(s.hidden), group["hidden"][a:b])
            assert np.array_equal(s.tokens.numpy(), group["tokens"][a:b])


@pytest.mark.parametrize("where,hidden_format", [("chunk", "bf16"), ("index", "bf16"), ("chunk", "fp8")])
def test_a_damaged_byte_is_an_error_naming_the_file(tmp_path, request, where, hidden_format):
    store = written(tmp_path, request, hidden_format)
    path = tmp_path / "copy.zarr" / "shards" / "00001" / "hidden" / "c.2.0.0"
    data = bytearray(path.read_bytes())
    data[100 if where == "chunk" else -10] ^= 0x01
    path.write_bytes(bytes(data))
    direct, _ = readers(store)["hidden"]
    with pytest.raises(StoreCorrupt, match="c.2.0.0.*crc32c"):
        direct.read(64, 72)
    assert np.array_equal(direct.read(0, 64), zarr.open_array(str(path.parent), mode="r")[0:64])


def test_a_damaged_token_chunk_is_an_error(tmp_path, request):
    store = written(tmp_path, request)
    path = tmp_path / "copy.zarr" / "shards" / "00001" / "tokens" / "c.0"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(StoreCorrupt, match="tokens/c.0"):
        readers(store)["tokens"][0].read(0, 5)


def test_other_layouts_are_left_to_zarr(tmp_path):
    """tests/data/blosc_store (the retired --codec blosc): no direct readers, zarr reads it, the same values."""
    import shutil

    from tests.store.format.test_read_checks import BLOSC

    shutil.copytree(BLOSC, tmp_path / "b.zarr")
    store = HiddenStore(str(tmp_path / "b.zarr"))
    group = store.shard_arrays(1)
    assert all(span_reader.for_array(store.fs, store.path(f"shards/00001/{n}"), group[n]) is None for n in ARRAYS)
    reader = ShardReader(store, 1)
    assert reader._direct is None
    a, b = int(reader.offsets[2]), int(reader.offsets[3])
    assert torch.equal(reader[2].hidden.view(torch.int16), layout.from_bits(group["hidden"][a:b]).view(torch.int16))


def remote_like(store: HiddenStore) -> HiddenStore:
    """The store read as an object store is (store/io/byte_fetch.py's batched ranges, edge chunks kept in
    the cache), the same files through fsspec's generic cat_ranges."""
    store.local = False
    return store


@pytest.mark.parametrize("hidden_format", hidden_formats.NAMES)
@pytest.mark.parametrize("local", [True, False])
def test_samples_read_in_one_batch_are_bit_identical_to_zarr(tmp_path, request, hidden_format, local):
    """Every sample of shard 1 (spans across chunk and shard-file edges, the partial last file), read
    in batches of 4 in two orders (the second from a warm cache), equals zarr's read of its rows."""
    written(tmp_path, request, hidden_format)
    store = HiddenStore(str(tmp_path / "copy.zarr"))
    store = store if local else remote_like(store)
    reader = ShardReader(store, 1)
    group = store.shard_arrays(1)
    whole = {name: group[name][:] for name in ARRAYS}
    order = list(range(len(reader))) + list(np.random.default_rng(1).permutation(len(reader)))
    for lo in range(0, len(order), 4):
        got = read_samples([(reader, i, None, None) for i in order[lo : lo + 4]])
        for i, s in zip(order[lo : lo + 4], got):
            a, b = int(reader.offsets[i]), int(reader.offsets[i + 1])
            assert np.array_equal(layout.to_bits(s.hidden), whole["hidden"][a:b]), (i, a, b)
            assert np.array_equal(s.tokens.numpy(), whole["tokens"][a:b])
            assert np.array_equal(s.loss_mask.numpy(), whole["loss_mask"][a:b].astype(bool))
    assert local or store.cache.bytes > 0  # edges, indexes and token chunks were kept


@pytest.mark.parametrize("hidden_format", hidden_formats.NAMES)
def test_a_damaged_chunk_fails_only_its_samples_in_a_batch(tmp_path, request, hidden_format):
    """A flipped byte in a chunk of shard file 2 (tokens 64-95): the samples over that chunk are
    refused, naming the file, the others of the same batch read."""
    written(tmp_path, request, hidden_format)
    store = remote_like(HiddenStore(str(tmp_path / "copy.zarr")))
    reader = ShardReader(store, 1)
    path = tmp_path / "copy.zarr" / "shards" / "00001" / "hidden" / "c.2.0.0"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    index = np.frombuffer(bytes(data[-(16 * 4 + 4) : -4]), "<u8").reshape(4, 2)
    k = next(k for k in range(4) if index[k, 0] <= len(data) // 2 < index[k, 0] + index[k, 1])
    lo, hi = 64 + 8 * k, 72 + 8 * k  # the damaged chunk's tokens
    got = read_samples([(reader, i, None, None) for i in range(len(reader))])
    hit = [i for i in range(len(reader)) if reader.offsets[i] < hi and reader.offsets[i + 1] > lo]
    assert hit and len(hit) < len(reader)
    for i, s in enumerate(got):
        if i in hit:
            assert isinstance(s, StoreCorrupt) and "c.2.0.0" in str(s) and "crc32c" in str(s), s
        else:
            assert not isinstance(s, Exception), (i, s)
    with pytest.raises(StoreCorrupt, match="c.2.0.0"):
        reader.read(hit[0])
