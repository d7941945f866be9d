"""One micro-batch's loss (stages/train/step.py): the CUDA path equals the CPU path; the
slot-weighting and anchor-budget options are checked and named, a run trains with them, holds to
the budget, and its checkpoint records them."""

import json
from dataclasses import asdict

import pytest

from stages.train.config import TrainConfig
from store.errors import ConfigError


def test_defaults_are_todays_behaviour():
    c = TrainConfig()
    assert (c.slot_weights, c.anchor_budget) == ("exp", None)


@pytest.mark.parametrize("over,needle", [
    ({"slot_weights": "uniform"}, "--slot-weights uniform: expected one of exp, dpace"),
    ({"slot_weights": "dpace", "gamma": 7.0}, "--gamma 7.0: is only used by --slot-weights exp"),
    ({"dpace_alpha": 0.0}, "--dpace-alpha 0.0: expected 0 < alpha <= 1"),
    ({"dpace_alpha": 1.5}, "--dpace-alpha 1.5: expected 0 < alpha <= 1"),
    ({"anchor_budget": 0}, "--anchor-budget 0: must be at least 1"),
])
def test_bad_values_are_named(over, needle):
    with pytest.raises(ConfigError) as e:
        TrainConfig(**over)
    assert needle in str(e.value)


def test_dpace_needs_no_gamma_and_plans_carry_the_options():
    from stages.train.step import LossPlan
    from tests.drafters import config

    TrainConfig(slot_weights="dpace", block_size=12)  # no default gamma for B=12, and none needed
    dc = config(block_size=16)
    plan = LossPlan.of(TrainConfig(slot_weights="dpace", dpace_alpha=0.3, anchor_budget=40, anchors=16), dc, False)
    assert (plan.gamma, plan.dpace_alpha, plan.anchor_budget, plan.width) == (None, 0.3, 40, 16)
    plan = LossPlan.of(TrainConfig(anchor_budget=8, anchors=16), dc, True)
    assert (plan.gamma, plan.dpace_alpha, plan.width) == (7.0, None, 8)  # exp: the default gamma of B=16


def test_resume_refuses_changed_options():
    from stages.train.run_dir import resumable

    before = asdict(TrainConfig())
    for over in ({"slot_weights": "dpace"}, {"dpace_alpha": 0.7}, {"anchor_budget": 64}):
        with pytest.raises(ConfigError, match="--" + next(iter(over)).replace("_", "-")):
            resumable(TrainConfig(**over), before)
    older = {k: v for k, v in before.items() if k not in ("slot_weights", "dpace_alpha", "anchor_budget")}
    resumable(TrainConfig(), older)  # a run saved before the options existed had their defaults
    with pytest.raises(ConfigError, match="--slot-weights was 'exp', now 'dpace'"):
        resumable(TrainConfig(slot_weights="dpace"), older)


def test_run_with_dpace_and_a_budget_trains_and_records_them(small_store, tmp_path):
    from pipeline.drafter import checkpoint
    from stages.train.run import run

    out = tmp_path / "run"
    run(TrainConfig(store=str(small_store), out=str(out), max_steps=16, save_every=0, log_every=1, workers=0,
                    threads=1, num_layers=1, anchors=16, batch_size=2, slot_weights="dpace", dpace_alpha=0.4,
                    anchor_budget=12), log=lambda m: None)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert len(train) == 16 and all(r["blocks"] <= 12 for r in train) and max(r["blocks"] for r in train) == 12
    assert train[-1]["loss"] < train[0]["loss"] - 0.5  # it learns
    _, _, record = checkpoint.load(out / "final")
    assert {k: record.train_config[k] for k in ("slot_weights", "dpace_alpha", "anchor_budget")} == \
        {"slot_weights": "dpace", "dpace_alpha": 0.4, "anchor_budget": 12}
    written = json.loads((out / "final" / "config.json").read_text())["dflash_pipeline"]["train_config"]
    assert (written["slot_weights"], written["anchor_budget"]) == ("dpace", 12)


@pytest.mark.parametrize("over,blocks", [
    ({"num_layers": 2, "layer_types": "sliding,full", "sliding_window": 5}, None),
    ({"num_layers": 1, "anchor_budget": 20, "slot_weights": "dpace"}, 20),  # rows padded to min(anchors, budget)
])
def test_cuda_path_padding_and_flex_give_the_cpu_loss(small_store, monkeypatch, over, blocks):
    """The CUDA path pads anchors and buckets the context for the compiled kernel, then runs flex;
    run eagerly on CPU (forward only) it gives the CPU path's loss and statistics."""
    import warnings

    import torch
    from torch.nn.attention.flex_attention import flex_attention

    from pipeline.drafter import attention
    from pipeline.drafter.model import Drafter
    from stages.train.data import StoreBatches, index_samples
    from stages.train.setup import drafter_config
    from stages.train.step import LossPlan, forward_loss, step_generator
    from store.hidden_store import HiddenStore

    monkeypatch.setattr(attention, "compiled_flex", lambda: flex_attention)
    store = HiddenStore(str(small_store))
    config = TrainConfig(anchors=64, **over)
    dc, _ = drafter_config(config, store.attrs, None)
    model = Drafter(dc, store.embedding("embed_tokens").float(), store.embedding("lm_head").float()).eval()
    model.init_weights(torch.Generator().manual_seed(0), std=0.1)
    batch = StoreBatches(str(small_store), [index_samples(store, [0, 1], 200)[:3]])[0]
    outs = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for flex in (False, True):
            outs.append(forward_loss(model, model, batch, LossPlan.of(config, dc, flex),
                                     step_generator(0, 1, 0, 0, torch.device("cpu"))))
    assert torch.allclose(outs[0].loss, outs[1].loss, atol=1e-5)
    assert torch.equal(outs[0].sums[2:], outs[1].sums[2:])  # same blocks, labels, streaks, per-slot counts
    assert blocks is None or outs[0].sums[3] == blocks  # with a budget: that many blocks, all labelled
