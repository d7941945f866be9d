"""A target loaded without its weights (--capture vllm) is the loaded target's twin in all but the
weights: the same identity record, tokenizer, sizes and EOS ids, and nothing that could run."""

import json
import shutil

import pytest
import torch

from pipeline import TINY_TARGET
from pipeline.target import loading
from tests.targets import multimodal_checkpoint


def twins(path: str) -> tuple:
    return loading.load(path, "cpu", "bf16", "torch"), loading.load(path, "cpu", "bf16", "torch", with_weights=False)


def test_without_weights_the_record_sizes_and_tokens_are_the_full_loads():
    full, bare = twins(str(TINY_TARGET))
    assert bare.record == full.record
    assert (bare.vocab_size, bare.num_layers, bare.hidden_size) == (full.vocab_size, full.num_layers, full.hidden_size)
    assert bare.eos_ids == full.eos_ids and bare.pad_id == full.pad_id
    assert bare.tokenizer("def f(x):").input_ids == full.tokenizer("def f(x):").input_ids
    for part in ("get_input_embeddings", "get_output_embeddings"):  # the two tensors the store keeps
        assert torch.equal(getattr(bare.model, part)().weight, getattr(full.model, part)().weight)
    embeddings = {id(bare.model.get_input_embeddings().weight), id(bare.model.get_output_embeddings().weight)}
    assert all(p.is_meta for p in bare.model.parameters() if id(p) not in embeddings)
    assert bare.device.type == "meta"
    with pytest.raises(Exception):  # no weights, no forward
        bare.capture([[1, 2, 3]], [0])


def test_without_weights_a_multimodal_release_records_its_text_model_as_a_full_load_does(tmp_path):
    full, bare = twins(str(multimodal_checkpoint(tmp_path / "mm")))
    assert bare.record == full.record
    assert bare.record.non_text_tensors  # the vision tower and mtp tensors it knowingly leaves
    assert torch.equal(bare.model.get_input_embeddings().weight, full.model.get_input_embeddings().weight)


def test_without_weights_the_eos_ids_come_from_generation_config(tmp_path):
    target = shutil.copytree(TINY_TARGET, tmp_path / "t")
    config = (
        json.loads((target / "generation_config.json").read_text())
        if (target / "generation_config.json").exists()
        else {}
    )
    (target / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [2, 7]}))
    full, bare = twins(str(target))
    assert bare.eos_ids == full.eos_ids == [2, 7]


def test_without_weights_a_tied_lm_head_is_the_embedding(tmp_path):
    from safetensors.torch import load_file, save_file

    target = shutil.copytree(TINY_TARGET, tmp_path / "t")
    state = load_file(target / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    full, bare = twins(str(target))
    assert bare.record == full.record
    assert bare.model.get_output_embeddings().weight is bare.model.get_input_embeddings().weight
    assert torch.equal(bare.model.get_output_embeddings().weight, full.model.get_output_embeddings().weight)
