"""The store as a whole: compatibility of a run with the root, commit status, reads, object stores."""

import shutil
import threading

import pytest

from stages.extract.config import ExtractConfig
from stages.extract.run import run
from store.errors import ConfigError, NotAStore, NotCommitted, StoreMismatch
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader
from store.store_writer import StoreWriter
from store.verify import verify
from tests.conftest import SMALL


def test_store_refuses_shards_from_another_config(store_copy, small_dataset):
    config = ExtractConfig(
        store=str(store_copy),
        dataset=str(small_dataset),
        taps="1,3",
        shards="0",
        num_shards=4,
        **{**SMALL, "max_new_tokens": 30},
    )
    with pytest.raises(StoreMismatch) as e:
        run(config, log=lambda m: None)
    msg = str(e.value)
    assert "different target/taps/config" in msg and "taps: store has [1, 2, 3, 4, 5], this run has [1, 3]" in msg
    assert "max_new_tokens" in msg and "fingerprint" not in msg.split("(")[1].split(":")[0]


def test_only_a_store_with_final_states_serves_what_needs_them(small_store, final_store):
    HiddenStore(str(final_store)).require_final_state("--soft-targets", "kl", "p")
    with pytest.raises(ConfigError, match=rf"--soft-targets kl: {small_store} holds no final states \(p comes"):
        HiddenStore(str(small_store)).require_final_state("--soft-targets", "kl", "p")


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


def test_bytes_on_disk_while_another_process_writes(store_copy):
    """Another rank renames and removes files while this one sums the store (the end-of-run
    summary of a multi-rank extract): files that vanish mid-walk are not counted, never an error."""
    store = HiddenStore(str(store_copy))
    before = store.bytes_on_disk()
    busy = store_copy / "shards" / "busy"
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            busy.mkdir(exist_ok=True)
            for i in range(50):
                (busy / f"tmp{i}").write_bytes(b"x" * 100)
            shutil.rmtree(busy)

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        sizes = [store.bytes_on_disk() for _ in range(200)]
    finally:
        stop.set()
        worker.join()
    assert min(sizes) >= before and max(sizes) <= before + 50 * 100
    assert store.bytes_on_disk() == before == sum(f.stat().st_size for f in store_copy.rglob("*") if f.is_file())


def test_readers_are_warned_of_what_they_cannot_check(store_copy):
    import dataclasses

    store = StoreWriter(str(store_copy))
    assert store.read_checks().warning() is None  # every shard written today: nothing unchecked
    for shard in (1, 2):  # as a shard committed before every chunk was written
        store.write_commit(dataclasses.replace(store.commit_record(shard), every_chunk=None, metadata=None))
    warning = HiddenStore(str(store_copy)).read_checks().warning()
    assert "shards 1-2 were committed before format revision 3 wrote every chunk" in warning
    assert f"pipeline verify {store_copy} --shards 1-2" in warning
