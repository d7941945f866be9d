"""`pipeline verify`: every committed shard re-read and checked against its commit record."""


from store.hidden_store import HiddenStore
from store.verify import verify


def test_verify_passes_on_a_good_store(small_store):
    report = verify(HiddenStore(str(small_store)), expected=[0, 1, 2, 3])
    assert report.ok and report.checked == [0, 1, 2, 3] and not report.partial


def test_verify_names_a_corrupted_chunk_file(store_copy):
    chunks = sorted(p for p in (store_copy / "shards/00002/hidden/c").rglob("*") if p.is_file())
    assert chunks
    data = bytearray(chunks[0].read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of a compressed chunk
    chunks[0].write_bytes(bytes(data))
    report = verify(HiddenStore(str(store_copy)))
    assert list(report.problems) == [2]
    assert "hidden" in report.problems[2][0]


def test_verify_names_a_deleted_chunk_and_a_missing_shard(store_copy):
    next(p for p in (store_copy / "shards/00001/hidden/c").rglob("*") if p.is_file()).unlink()
    (store_copy / "_commits/00003.json").unlink()
    report = verify(HiddenStore(str(store_copy)), expected=[0, 1, 2, 3])
    assert list(report.problems) == [1] and report.missing == [3] and report.partial == [3]
    assert not report.ok


def test_verify_catches_a_tampered_token(store_copy):
    import zarr

    tokens = zarr.open_array(str(store_copy / "shards/00000/tokens"), mode="r+")
    tokens[5] = tokens[5] + 1
    report = verify(HiddenStore(str(store_copy)))
    assert report.problems == {0: ["tokens: checksum mismatch"]}


def test_verify_checks_the_frozen_embedding(store_copy):
    import zarr

    embed = zarr.open_array(str(store_copy / "target/embed_tokens"), mode="r+")
    embed[0, 0] = embed[0, 0] ^ 1
    report = verify(HiddenStore(str(store_copy)))
    assert report.problems == {-1: ["target/embed_tokens: checksum mismatch"]}
