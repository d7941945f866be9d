"""`pipeline verify`: every committed shard re-read and checked against its commit record."""

from store.hidden_store import HiddenStore
from store.verify import verify


def test_verify_passes_on_a_good_store(small_store):
    report = verify(HiddenStore(str(small_store)), expected=[0, 1, 2, 3])
    assert report.ok and report.checked == [0, 1, 2, 3] and not report.partial


def test_verify_names_a_corrupted_chunk_file(store_copy):
    chunks = sorted(p for p in (store_copy / "shards/00002/hidden").glob("c.*"))
    assert chunks
    data = bytearray(chunks[0].read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of a compressed chunk
    chunks[0].write_bytes(bytes(data))
    report = verify(HiddenStore(str(store_copy)))
    assert list(report.problems) == [2]
    assert "hidden" in report.problems[2][0]


def test_verify_names_a_deleted_chunk_and_a_missing_shard(store_copy):
    next(p for p in (store_copy / "shards/00001/hidden").glob("c.*")).unlink()
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
    assert report.problems == {
        -1: [
            f"{store_copy}/target/embed_tokens: its CRC-32 is not the one _commits/root.json "
            "records (a chunk file is damaged, missing or replaced)"
        ]
    }


def test_chosen_shards_in_parallel_processes(store_copy):
    """--shards limits what is read; two processes find what one finds."""
    chunks = sorted(p for p in (store_copy / "shards/00002/hidden").glob("c.*"))
    data = bytearray(chunks[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunks[0].write_bytes(bytes(data))
    store = HiddenStore(str(store_copy))
    chosen = verify(store, expected=[0, 1])
    assert chosen.ok and chosen.checked == [0, 1]
    one, two = verify(store), verify(store, processes=2)
    assert list(one.problems) == list(two.problems) == [2] and two.checked == [0, 1, 2, 3]
    assert one.problems == two.problems and one.chunks == two.chunks


def test_a_sample_of_chunks_states_its_coverage_and_finds_damage_it_reads(store_copy):
    """Schema 2 checks each chunk on its own, so a sampled check still finds a damaged chunk it
    decodes; the verdict says how much was decoded."""
    store = HiddenStore(str(store_copy))
    full = verify(store)
    sampled = verify(store, sample=0.5)
    decoded, total = sampled.chunks
    assert full.chunks == [total, total] and 0 < decoded < total
    assert f"{decoded} of {total} chunks decoded" in sampled.verdict()
    files = sorted(p for p in (store_copy / "shards/00001/hidden").glob("c.*"))
    data = bytearray(files[0].read_bytes())
    for k in range(0, len(data) - 64, 97):  # damage every chunk of the file: any sampled one is hit
        data[k] ^= 0xFF
    files[0].write_bytes(bytes(data))
    report = verify(HiddenStore(str(store_copy)), sample=0.5)
    assert list(report.problems) == [1] and "unreadable" in report.problems[1][0]
