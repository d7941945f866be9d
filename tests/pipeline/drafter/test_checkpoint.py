"""Checkpoints in the public DFlash layout: round trip, strict loading, released configs."""

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.drafter import checkpoint
from pipeline.drafter.config import DrafterConfig, TrainingRecord, read_config
from pipeline.errors import DrafterError
from tests.drafters import RELEASED_27B, config, drafter
from tests.modes import as_another_user, file_modes, umask


def test_round_trip(tmp_path):
    m = drafter()
    record = TrainingRecord(store_fingerprint="abc", train_shards="0-2", eval_shards="3", step=5, store_taps=(1, 3))
    checkpoint.save(tmp_path / "ck", m.config, m.state_dict(), record)
    c, tensors, loaded = checkpoint.load(tmp_path / "ck")
    assert c == m.config and loaded == record
    for k, v in m.state_dict().items():
        assert torch.equal(tensors[k], v.to(torch.bfloat16)), k
    d = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
    assert d["dflash_config"]["mask_token_id"] == m.config.mask_token_id
    assert d["dflash_config"]["target_layer_ids"] == list(m.config.target_layer_ids) and d["block_size"] == 4
    assert not list(tmp_path.glob(".ck*"))  # no temporary left behind


@pytest.mark.parametrize("mask, mode", [(0o022, "0644"), (0o077, "0600"), (0o002, "0664")])
def test_every_file_is_as_readable_as_the_umask_makes_files(tmp_path, mask, mode):
    """safetensors writes model.safetensors owner-only (0600) whatever the umask: a serving engine or a
    teammate under another account could not read it. Every file gets the user's usual mode."""
    m = drafter()
    with umask(mask):
        checkpoint.save(tmp_path / "ck", m.config, m.state_dict())
    assert file_modes(tmp_path / "ck") == {f: mode for f in checkpoint.SERVING_FILES}


def test_another_account_reads_a_saved_checkpoint_and_is_told_when_it_may_not():
    m = drafter()
    with tempfile.TemporaryDirectory() as tmp, umask(0o022):
        Path(tmp).chmod(0o755)  # a shared directory
        ck = checkpoint.save(Path(tmp) / "ck", m.config, m.state_dict())
        assert as_another_user(lambda: checkpoint.inspect(ck)[0]) == m.config
        (ck / checkpoint.WEIGHTS).chmod(0o600 if os.geteuid() == 0 else 0)  # owner-only, as written before
        for fn in (checkpoint.inspect, checkpoint.load):
            e = as_another_user(lambda: fn(ck))
            assert isinstance(e, DrafterError), e
            assert str(e).startswith(f"{ck / checkpoint.WEIGHTS}: permission denied: mode 0"), e  # not "No such file"
            assert "chmod a+r" in str(e)


def tamper(tmp_path, edit) -> str:
    m = drafter()
    checkpoint.save(tmp_path / "ck", m.config, m.state_dict())
    path = tmp_path / "ck" / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))
    with pytest.raises(DrafterError) as e:
        checkpoint.load(tmp_path / "ck")
    with pytest.raises(DrafterError) as header:
        checkpoint.inspect(tmp_path / "ck")
    assert str(header.value) == str(e.value)  # the weights file's header alone is as strict as loading it
    return str(e.value)


def test_strict_loading_names_missing_tensors(tmp_path):
    msg = tamper(tmp_path, lambda t: (t.pop("fc.weight"), t.pop("layers.1.mlp.up_proj.weight")))
    assert "missing: fc.weight, layers.1.mlp.up_proj.weight" in msg


def test_strict_loading_names_unexpected_and_misshaped(tmp_path):
    def edit(t):
        t["lm_head.weight"] = torch.zeros(2, 2)
        t["fc.weight"] = torch.zeros(32, 4 * 32)  # 4 taps' worth, the config says 2

    msg = tamper(tmp_path, edit)
    assert "unexpected: lm_head.weight" in msg and "fc.weight (32, 128) (config needs (32, 64))" in msg


def test_a_drafter_cannot_load_into_another_shape():
    m, other = drafter(), drafter(config(target_layer_ids=(1, 2, 3)))
    with pytest.raises(DrafterError, match="fc.weight"):
        checkpoint.check_tensors(other.config, m.state_dict(), "x")


def test_released_config_reads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RELEASED_27B))
    c, record = read_config(tmp_path)
    assert record is None and c.block_size == 16 and c.mask_token_id == 248070
    assert c.target_layer_ids == (1, 16, 31, 46, 61) and c.rope_parameters["rope_theta"] == 1e7
    assert [c.layer_rule(i) for i in range(5)] == [(True, 2048)] * 4 + [(False, None)]
    shapes = checkpoint.expected_shapes(c)
    assert sum(torch.Size(s).numel() for s in shapes.values()) == pytest.approx(1.73e9, rel=0.01)
    again = DrafterConfig.from_hf(c.to_hf())
    assert again == c


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda d: d["dflash_config"].pop("mask_token_id"), "missing field 'mask_token_id'"),
        (lambda d: d.update(architectures=["DFlash2DraftModel"]), "only DFlashDraftModel"),
        (lambda d: d["dflash_config"].update(mask_token_id=10**6), "outside the vocabulary"),
        (lambda d: d.update(layer_types=["full_attention"]), "layer_types has 1 entries for 5 layers"),
    ],
)
def test_bad_configs_are_named(tmp_path, edit, needle):
    d = json.loads(json.dumps(RELEASED_27B))
    edit(d)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(DrafterError, match=needle):
        read_config(tmp_path)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 1e7},
        {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
        {"rope_type": "yarn", "rope_theta": 1e7, "factor": 4.0, "original_max_position_embeddings": 8192},
    ],
)
def test_rope_is_written_in_the_v5_and_the_legacy_fields(rope):
    """config.json carries rope_parameters and, for older readers, rope_theta / partial_rotary_factor /
    rope_scaling; a reader of either form gets the same settings back."""
    c = config(rope_parameters=rope)
    d = c.to_hf()
    assert d["rope_parameters"] == rope and d["rope_theta"] == rope["rope_theta"]
    assert ("partial_rotary_factor" in d) == ("partial_rotary_factor" in rope)
    assert ("rope_scaling" in d) == (rope["rope_type"] != "default")
    if "rope_scaling" in d:
        assert d["rope_scaling"]["type"] == d["rope_scaling"]["rope_type"] == "yarn"
    legacy = {k: v for k, v in d.items() if k != "rope_parameters"}
    assert DrafterConfig.from_hf(d) == DrafterConfig.from_hf(legacy) == c


def test_input_embedding_scale_is_written_only_when_it_is_not_one():
    plain, scaled = config(), config(input_embedding_scale=0.5)
    assert "input_embedding_scale" not in plain.to_hf()["dflash_config"]
    assert scaled.to_hf()["dflash_config"]["input_embedding_scale"] == 0.5
    assert DrafterConfig.from_hf(plain.to_hf()) == plain and DrafterConfig.from_hf(scaled.to_hf()) == scaled
