"""Target checkpoints load strictly: no tensor left random, only known non-text parts unused."""

import pytest
import torch

from pipeline.errors import TargetError
from pipeline.target import loading
from stages.extract.config import ExtractConfig
from stages.extract.run import run
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader
from tests.conftest import SMALL
from tests.processes import cli_args, run_pipeline
from tests.targets import damaged_checkpoint, multimodal_checkpoint


def drop(name):
    return lambda state: state.pop(name)


def shorten(name):
    return lambda state: state.update({name: state[name][:-1].clone()})


def add(name):
    return lambda state: state.update({name: torch.zeros(3)})


@pytest.mark.parametrize(
    "edit,needle",
    [
        (
            drop("model.layers.3.mlp.down_proj.weight"),
            "missing (would be left random): model.layers.3.mlp.down_proj.weight",
        ),
        (drop("model.layers.0.linear_attn.A_log"), "missing (would be left random): model.layers.0.linear_attn.A_log"),
        (
            shorten("model.layers.2.mlp.up_proj.weight"),
            "wrong shape (would be left random): model.layers.2.mlp.up_proj.weight "
            "(checkpoint (383, 128), model (384, 128))",
        ),
        (
            add("model.layers.1.extra.weight"),
            "not used by Qwen3_5ForCausalLM and not a known non-text part: model.layers.1.extra.weight",
        ),
    ],
)
def test_a_damaged_checkpoint_is_refused_naming_the_tensor(tmp_path, edit, needle):
    path = damaged_checkpoint(tmp_path / "target", edit)
    with pytest.raises(TargetError) as e:
        loading.load(str(path), "cpu", "fp32", "auto")
    assert needle in str(e.value) and str(e.value).startswith(f"--target {path}: the checkpoint does not match")


def test_extract_from_a_damaged_checkpoint_is_one_line_and_writes_nothing(tmp_path, small_dataset):
    path = damaged_checkpoint(tmp_path / "target", drop("model.layers.3.mlp.down_proj.weight"))
    store = tmp_path / "hs.zarr"
    p = run_pipeline(cli_args(store, small_dataset, "0") + ["--target", str(path)])
    assert p.returncode == 2
    assert (
        p.stderr.strip().splitlines()[-1].startswith("error: --target ") and "model.layers.3.mlp.down_proj" in p.stderr
    )
    assert not store.exists()


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    return multimodal_checkpoint(tmp_path_factory.mktemp("release") / "qwen3_5")


def test_a_multimodal_release_loads_as_the_text_model_with_its_parts_recorded(multimodal, target):
    t = loading.load(str(multimodal), "cpu", "fp32", "auto")
    assert type(t.model).__name__ == "Qwen3_5ForCausalLM" == type(target.model).__name__
    assert t.record.non_text_tensors == {"^mtp.*": 1, "^model.visual.*": t.record.non_text_tensors["^model.visual.*"]}
    assert t.record.non_text_tensors["^model.visual.*"] > 10
    assert t.record.tokenizer_class == "Qwen3_5Tokenizer" != target.record.tokenizer_class  # transformers' own
    assert target.record.non_text_tensors == {}  # recorded (none): not None, which means not recorded
    ids = [[5, 17, 300, 42, 9, 1000, 7], [3, 4, 5]]
    assert torch.equal(t.capture(ids, [1, 3, 7]), target.capture(ids, [1, 3, 7]))  # bit-identical


def test_extraction_from_a_multimodal_release_stores_the_text_models_states(
    multimodal, target, small_dataset, tmp_path
):
    path = tmp_path / "hs.zarr"
    run(
        ExtractConfig(
            store=str(path),
            target=str(multimodal),
            dataset=str(small_dataset),
            shards="0",
            num_shards=4,
            **{**SMALL, "batch_size": 1},
        ),
        log=lambda m: None,
    )  # unbatched, as compared
    store = HiddenStore(str(path))
    assert (
        store.attrs.target.non_text_tensors["^mtp.*"] == 1 and store.attrs.target.tokenizer_class == "Qwen3_5Tokenizer"
    )
    samples = list(ShardReader(store, 0))
    assert samples
    for s in samples:  # the same token ids through the text-only target: the same states, bit for bit
        assert torch.equal(s.hidden, target.capture([s.tokens.tolist()], list(store.attrs.taps)))
