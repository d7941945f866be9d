import shutil
from pathlib import Path

import pytest

from store.errors import NotAStore, NotCommitted, StoreMismatch
from stages.extract.config import ExtractConfig
from stages.extract.run import run
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader
from store.summary import render, summarize
from store.verify import verify
from tests.conftest import SMALL


@pytest.fixture
def store_copy(small_store, tmp_path) -> Path:
    dst = tmp_path / "copy.zarr"
    shutil.copytree(small_store, dst)
    return dst


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


def test_info_summarizes(small_store):
    s = summarize(HiddenStore(str(small_store)))
    assert s["shards_done"] == 4 and s["missing"] == "" and s["samples"] > 0
    assert s["skipped"]["empty_prompt"] == 1 and s["skipped"]["prompt_too_long"] == 1
    assert s["compression_ratio"] > 1.0 and s["provenance"]["linear_attention"] == "torch"
    text = render(s)
    assert "4/4 done" in text and "linear attention: torch" in text


def test_store_refuses_shards_from_another_config(store_copy, small_dataset):
    config = ExtractConfig(store=str(store_copy), dataset=str(small_dataset), taps="1,3", shards="0", num_shards=4,
                           **{**SMALL, "max_new_tokens": 30})
    with pytest.raises(StoreMismatch) as e:
        run(config, log=lambda m: None)
    msg = str(e.value)
    assert "different target/taps/config" in msg and "taps: store has [1, 2, 3, 4, 5], this run has [1, 3]" in msg
    assert "max_new_tokens" in msg and "fingerprint" not in msg.split("(")[1].split(":")[0]


def test_reader_rejects_uncommitted_shard(store_copy):
    (store_copy / "_commits/00001.json").unlink()
    with pytest.raises(NotCommitted, match="shard 1 is not committed"):
        ShardReader(HiddenStore(str(store_copy)), 1)


def test_not_a_store(tmp_path):
    with pytest.raises(NotAStore, match="not a hidden-state store"):
        HiddenStore(str(tmp_path)).attrs


def test_fsspec_url_store_and_empty_shards(small_dataset):
    """An object-store URL (fsspec memory://): no locks, commit files by put; empty shards commit too."""
    url = "memory://fsspec-test/hs.zarr"
    config = ExtractConfig(store=url, dataset=str(small_dataset), shards="0,1,5", num_shards=32, **SMALL)
    summary = run(config, log=lambda m: None)
    store = HiddenStore(url)
    assert not store.local and list(store.committed()) == [0, 1, 5]
    assert store.commit_record(0).samples == 0 and summary["samples"] == 2  # 16 rows over 32 shards
    assert verify(store).ok
    sample = ShardReader(store, 1)[0]
    assert sample.hidden.shape == (len(sample.tokens), 5, 128)
