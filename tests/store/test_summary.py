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
