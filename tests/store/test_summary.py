"""`pipeline info`: what a store holds and how it was made."""

from store.hidden_store import HiddenStore
from store.summary import render, summarize


def test_info_summarizes(small_store):
    s = summarize(HiddenStore(str(small_store)))
    assert s["shards_done"] == 4 and s["missing"] == "" and s["samples"] > 0
    assert s["skipped"]["empty_prompt"] == 1 and s["skipped"]["prompt_too_long"] == 1
    assert s["compression_ratio"] > 1.0 and s["provenance"]["linear_attention"] == "torch"
    text = render(s)
    assert "4/4 done" in text and "linear attention: torch" in text
    assert "capture      the target loaded by the extracting process (transformers)" in text


def test_sizes_come_from_the_commit_files_not_a_walk(small_store, monkeypatch):
    """At scale a walk is millions of metadata calls: info reads each shard's bytes, recorded at
    commit, and walks only the root's two arrays; the figures equal what a walk finds."""
    store = HiddenStore(str(small_store))
    walked = {
        "hidden": sum(store.bytes_on_disk(f"shards/{s:05d}/hidden") for s in store.committed()),
        "all": store.bytes_on_disk("target") + sum(store.bytes_on_disk(f"shards/{s:05d}") for s in store.committed()),
    }
    calls = []
    real = HiddenStore._file_sizes  # every walk goes through it
    monkeypatch.setattr(HiddenStore, "_file_sizes", lambda self, key: calls.append(key) or real(self, key))
    s = summarize(store)
    assert calls == ["target"]
    assert s["hidden_bytes_on_disk"] == walked["hidden"] and s["bytes_on_disk"] == walked["all"]


def test_older_commit_files_without_sizes_are_walked(tmp_path):
    import shutil
    from pathlib import Path

    path = tmp_path / "v1.zarr"
    shutil.copytree(Path(__file__).resolve().parents[1] / "data" / "schema1_store", path)
    store = HiddenStore(str(path))
    assert all(r.bytes is None for r in store.committed().values())
    s = summarize(store)
    assert s["hidden_bytes_on_disk"] == sum(store.bytes_on_disk(f"shards/{k:05d}/hidden") for k in (0, 1)) > 0
