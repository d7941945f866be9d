"""evaluate.py: the report, conditioning checks, released checkpoints, one-line errors."""

import json
import subprocess
import sys

import pytest
import torch

from pipeline.drafter import checkpoint
from pipeline.drafter.config import TrainingRecord
from pipeline.errors import DrafterError
from stages.evaluate.config import EvalConfig
from stages.evaluate.run import run
from store.hidden_store import HiddenStore
from tests.conftest import REPO
from tests.drafters import write_released


def our_checkpoint(store_path, directory, **record):
    from pipeline.drafter.model import Drafter
    from stages.train.config import TrainConfig
    from stages.train.setup import drafter_config

    store = HiddenStore(str(store_path))
    dc, _ = drafter_config(TrainConfig(num_layers=2), store.attrs, None)
    m = Drafter(dc, store.embedding("embed_tokens"), store.embedding("lm_head"))
    m.init_weights(torch.Generator().manual_seed(0))
    info = {"store_fingerprint": store.attrs.fingerprint, "train_shards": "0-2", "eval_shards": "3", "step": 7}
    checkpoint.save(directory, dc, m.state_dict(), TrainingRecord(**{**info, **record}))
    return directory


def evaluate(store, tmp_path, *cks, **over):
    return run(EvalConfig(store=str(store), checkpoints=tuple(map(str, cks)), out=str(tmp_path / "rep"),
                          ddtree=(1, 8), **over), log=lambda m: None)


def test_report_schema_and_files(small_store, tmp_path):
    ck = our_checkpoint(small_store, tmp_path / "ck")
    rep = evaluate(small_store, tmp_path, ck)
    assert rep["shards"] == "3" and rep["warnings"] == []  # the checkpoint's held-out shards by default
    r = rep["checkpoints"][0]
    for key in ("tau", "tau_pooled", "histogram", "per_slot", "ddtree", "per_prompt"):
        assert key in r, key
    assert len(r["histogram"]) == 16 and len(r["per_slot"]) == 15 and set(r["ddtree"]) == {"1", "8"}
    assert 1 <= r["tau_pooled"] <= 16 and 1 <= r["ddtree"]["1"] <= 2  # budget 1: at most 2 tokens per round
    assert r["check"] == "store fingerprint matches"
    assert sum(r["histogram"]) == r["rounds"] == sum(p["rounds"] for p in r["per_prompt"])
    for name in ("report.json", "report.md", "histogram.png", "per_slot.png"):
        assert (tmp_path / "rep" / name).stat().st_size > 0
    assert json.loads((tmp_path / "rep" / "report.json").read_text())["checkpoints"][0]["tau"] == r["tau"]
    assert "mean over prompts" in (tmp_path / "rep" / "report.md").read_text()


def test_other_store_is_refused_unless_allowed(small_store, tmp_path):
    ck = our_checkpoint(small_store, tmp_path / "ck", store_fingerprint="0" * 64)
    with pytest.raises(DrafterError, match="not trained on this store's conditioning.*store fingerprint"):
        evaluate(small_store, tmp_path, ck)
    rep = evaluate(small_store, tmp_path, ck, allow_mismatch=True)
    assert rep["warnings"][0].startswith("MISMATCH allowed")
    assert (tmp_path / "rep" / "report.md").read_text().splitlines()[2].startswith("> **WARNING:** MISMATCH")


def test_overlap_with_training_shards_warns(small_store, tmp_path):
    ck = our_checkpoint(small_store, tmp_path / "ck")
    rep = evaluate(small_store, tmp_path, ck, shards="1-3")
    assert any("trained on shards 1-2" in w for w in rep["warnings"])


def test_released_checkpoint_loads_strictly_and_evaluates(small_store, tmp_path):
    attrs = HiddenStore(str(small_store)).attrs
    written = write_released(tmp_path / "released", attrs.hidden_size, attrs.vocab_size, attrs.taps, attrs.mask_token_id)
    config, tensors, record = checkpoint.load(tmp_path / "released")
    assert record is None and all(torch.equal(tensors[k], v) for k, v in written.items())
    assert config.layer_rule(0) == (True, 64) and config.layer_rule(1) == (False, None)
    rep = evaluate(small_store, tmp_path, tmp_path / "released", our_checkpoint(small_store, tmp_path / "ours"))
    assert rep["shards"] == "3"  # from our checkpoint's record
    assert "store fingerprint not checked" in rep["checkpoints"][0]["check"]
    assert any("carries no store fingerprint" in w for w in rep["warnings"])
    assert [r["prompts"] for r in rep["checkpoints"]] == [rep["checkpoints"][1]["prompts"]] * 2


def test_released_checkpoint_with_other_taps_is_refused(small_store, tmp_path):
    attrs = HiddenStore(str(small_store)).attrs
    write_released(tmp_path / "r", attrs.hidden_size, attrs.vocab_size, [0, 2, 4, 6, 7], attrs.mask_token_id)
    with pytest.raises(DrafterError, match=r"taps: checkpoint \[0, 2, 4, 6, 7\], store \[1, 2, 3, 4, 5\]"):
        evaluate(small_store, tmp_path, tmp_path / "r")


def test_cli_one_line_error(tmp_path, small_store):
    r = subprocess.run([sys.executable, "evaluate.py", "--store", str(small_store), "--checkpoint", str(tmp_path / "no")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no such file" in r.stderr
