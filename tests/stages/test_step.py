"""One micro-batch's loss (stages/train/step.py): the CUDA path equals the CPU path; the
slot-weighting and anchor-budget options are checked and named, a run trains with them, holds to
the budget, and its checkpoint records them."""

import json

import pytest

from stages.train.config import LossConfig, TrainConfig
from store.errors import ConfigError


def test_defaults_are_the_recipe_benchs_choice():
    """docs/training.md, "Choosing the defaults": Muon, D-PACE, random batches; the rest as SPEC."""
    c = TrainConfig()
    assert (c.optim.optimizer, c.loss.slot_weights, c.data.batching, c.loss.anchor_budget) == (
        "muon",
        "dpace",
        "random",
        None,
    )
    assert (
        c.optim.lr,
        c.optim.muon_lr,
        c.optim.schedule,
        c.optim.warmup_ratio,
        c.loss.loss_norm,
        c.loss.anchor_rule,
        c.loss.noise_std,
    ) == (6e-4, None, "cosine", 0.04, "weights", "pair", 0.0)


@pytest.mark.parametrize(
    "over,needle",
    [
        ({"slot_weights": "uniform"}, "--slot-weights uniform: expected one of dpace, exp"),
        ({"gamma": 7.0}, "--gamma 7.0: is only used by --slot-weights exp"),
        ({"batching": "sorted"}, "--batching sorted: expected one of bucketed, random, packed"),
        ({"optimizer": "sgd"}, "--optimizer sgd: expected one of adamw, muon"),
        ({"loss_norm": "tokens"}, "--loss-norm tokens: expected one of weights, labels"),
        ({"dpace_alpha": 0.0}, "--dpace-alpha 0.0: expected 0 < alpha <= 1"),
        ({"dpace_alpha": 1.5}, "--dpace-alpha 1.5: expected 0 < alpha <= 1"),
        ({"anchor_budget": 0}, "--anchor-budget 0: must be at least 1"),
        ({"acceptance_weight": 2.0}, "--acceptance-weight 2.0: expected 0 <= weight <= 1"),
    ],
)
def test_bad_values_are_named(over, needle):
    with pytest.raises(ConfigError) as e:
        TrainConfig.of(**over)
    assert needle in str(e.value)


def test_dpace_needs_no_gamma_and_plans_carry_the_options():
    from stages.train.step import LossPlan
    from tests.drafters import config

    TrainConfig.of(slot_weights="dpace", block_size=12)  # no default gamma for B=12, and none needed
    dc = config(block_size=16)
    plan = LossPlan.of(LossConfig(slot_weights="dpace", dpace_alpha=0.3, anchor_budget=40, anchors=16), dc, False)
    assert (plan.gamma, plan.dpace_alpha, plan.anchor_budget, plan.width) == (None, 0.3, 40, 16)
    plan = LossPlan.of(LossConfig(anchor_budget=8, anchors=16, slot_weights="exp"), dc, True)
    assert (plan.gamma, plan.dpace_alpha, plan.width) == (7.0, None, 8)  # exp: the default gamma of B=16


def test_gamma_is_resolved_once_for_the_check_and_the_plan():
    """slot_gamma: --gamma, else the default of the block size (the config's when checking, the
    drafter's in the plan, so an --init-from checkpoint's decides); None with D-PACE."""
    from stages.train.step import LossPlan, slot_gamma
    from tests.drafters import config

    assert slot_gamma(LossConfig(), 16) is None and slot_gamma(LossConfig(slot_weights="exp"), 8) == 4.0
    assert slot_gamma(LossConfig(slot_weights="exp", gamma=2.5), 12) == 2.5
    with pytest.raises(ConfigError, match="--block-size 12: no default loss decay"):
        TrainConfig.of(slot_weights="exp", block_size=12)
    warm = TrainConfig.of(slot_weights="exp", block_size=12, init_from="ckpt")  # the checkpoint's size decides
    assert warm.loss.gamma is None  # the config holds what was given: a resumed run compares it (RESUME_FIXED)
    assert LossPlan.of(warm.loss, config(block_size=8), False).gamma == 4.0
    with pytest.raises(ConfigError, match="--block-size 12: no default loss decay"):
        LossPlan.of(LossConfig(slot_weights="exp"), config(block_size=12), False)


def test_resume_refuses_changed_options():
    from stages.train.run_dir import resumable

    before = TrainConfig().record()
    for over in (
        {"slot_weights": "exp"},
        {"dpace_alpha": 0.7},
        {"anchor_budget": 64},
        {"batching": "packed"},
        {"optimizer": "adamw"},
        {"muon_lr": 0.01},
        {"schedule": "linear"},
        {"noise": "uniform"},
        {"loss_norm": "labels"},
        {"anchor_rule": "single"},
        {"muon_weight_decay": 0.0},
    ):
        with pytest.raises(ConfigError, match="--" + next(iter(over)).replace("_", "-")):
            resumable(TrainConfig.of(**over), before)
    new = (
        "slot_weights",
        "dpace_alpha",
        "anchor_budget",
        "batching",
        "optimizer",
        "muon_lr",
        "muon_weight_decay",
        "schedule",
        "noise",
        "loss_norm",
        "anchor_rule",
    )
    older = {k: v for k, v in before.items() if k not in new}
    then = {"slot_weights": "exp", "batching": "bucketed", "optimizer": "adamw"}
    resumable(TrainConfig.of(**then), older)  # a run saved before the options existed: what training did then
    with pytest.raises(
        ConfigError,
        match="--batching was 'bucketed', now 'random'.*--optimizer was 'adamw', now "
        "'muon'.*--slot-weights was 'exp', now 'dpace'",
    ):  # in field order
        resumable(TrainConfig.of(), older)


def test_run_with_dpace_and_a_budget_trains_and_records_them(small_store, tmp_path):
    from pipeline.drafter import checkpoint
    from stages.train.run import run

    out = tmp_path / "run"
    run(
        TrainConfig.of(
            store=str(small_store),
            out=str(out),
            max_steps=16,
            save_every=0,
            log_every=1,
            workers=0,
            threads=1,
            num_layers=1,
            anchors=16,
            batch_size=2,
            slot_weights="dpace",
            dpace_alpha=0.4,
            anchor_budget=12,
        ),
        log=lambda m: None,
    )
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert len(train) == 16 and all(r["blocks"] <= 12 for r in train) and max(r["blocks"] for r in train) == 12
    assert train[-1]["loss"] < train[0]["loss"] - 0.5  # it learns
    _, _, record = checkpoint.load(out / "final")
    assert {k: record.train_config[k] for k in ("slot_weights", "dpace_alpha", "anchor_budget")} == {
        "slot_weights": "dpace",
        "dpace_alpha": 0.4,
        "anchor_budget": 12,
    }
    written = json.loads((out / "final" / "config.json").read_text())["dflash_pipeline"]["train_config"]
    assert (written["slot_weights"], written["anchor_budget"]) == ("dpace", 12)


@pytest.mark.parametrize(
    "over,blocks",
    [
        ({"num_layers": 2, "layer_types": "sliding,full", "sliding_window": 5}, None),
        ({"num_layers": 1, "anchor_budget": 20, "slot_weights": "dpace"}, 20),  # rows padded to min(anchors, budget)
    ],
)
def test_cuda_path_padding_and_flex_give_the_cpu_loss(small_store, monkeypatch, over, blocks):
    """The CUDA path pads anchors and buckets the context for the compiled kernel, then runs flex;
    run eagerly on CPU (forward only) it gives the CPU path's loss and statistics."""
    import warnings

    import torch
    from torch.nn.attention.flex_attention import flex_attention

    from pipeline.drafter import attention
    from pipeline.drafter.model import Drafter
    from stages.train.dataset import StoreBatches
    from stages.train.samples import index_samples
    from stages.train.setup import drafter_config
    from stages.train.step import LossPlan, forward_loss, step_generator
    from store.hidden_store import HiddenStore

    monkeypatch.setattr(attention, "compiled_flex", lambda: flex_attention)
    store = HiddenStore(str(small_store))
    config = TrainConfig.of(anchors=64, **over)
    dc, _ = drafter_config(config, store.attrs, None)
    model = Drafter(dc, store.embedding("embed_tokens").float(), store.embedding("lm_head").float()).eval()
    model.init_weights(torch.Generator().manual_seed(0), std=0.1)
    batch = StoreBatches(str(small_store), [[(r,) for r in index_samples(store, [0, 1], 200)[:3]]])[0]
    outs = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for flex in (False, True):
            outs.append(
                forward_loss(
                    model,
                    model,
                    batch,
                    LossPlan.of(config.loss, dc, flex),
                    step_generator(0, 1, 0, 0, torch.device("cpu")),
                )
            )
    assert torch.allclose(outs[0].loss, outs[1].loss, atol=1e-5)
    assert torch.equal(outs[0].sums[2:4], outs[1].sums[2:4])  # same blocks and streaks
    assert torch.equal(outs[0].sums[5:], outs[1].sums[5:])  # same labels and per-slot counts
    assert torch.allclose(outs[0].sums[4], outs[1].sums[4], rtol=1e-5)  # plain CE
    assert blocks is None or outs[0].sums[3] == blocks  # with a budget: that many blocks, all labelled


def recorded_forward(model, batch, plan, monkeypatch, anchors=None):
    """forward_loss with its anchors (drawn, or the given ones) and the drafter's output recorded."""
    import torch

    import stages.train.step as st
    from pipeline.drafter.blocks import sample_anchors as draw
    from pipeline.drafter.loss import dflash_loss as loss

    seen = {}

    def sample(*a, **k):
        seen["anchors"] = anchors if anchors is not None else draw(*a, **k)
        return seen["anchors"]

    monkeypatch.setattr(st, "sample_anchors", sample)
    monkeypatch.setattr(
        st, "dflash_loss", lambda h, labels, *a, **k: seen.update(h=h, labels=labels) or loss(h, labels, *a, **k)
    )
    with torch.no_grad():
        out = st.forward_loss(model, model, batch, plan, st.step_generator(0, 1, 0, 0, torch.device("cpu")))
    return out, seen


@pytest.mark.parametrize("flex", [False, True], ids=["local", "flex"])
@pytest.mark.parametrize("over", [{}, {"layer_types": "sliding,full", "sliding_window": 6}], ids=["full", "sliding"])
def test_a_packed_row_gives_each_sample_the_loss_it_gets_alone(small_store, monkeypatch, flex, over):
    """Three samples packed into one row, and each alone in its own row, with the same anchors: the
    same labels, the same drafter outputs at every block, so the same loss sums."""
    import warnings

    import torch
    from torch.nn.attention.flex_attention import flex_attention

    from pipeline.drafter import attention
    from pipeline.drafter.blocks import IGNORE
    from pipeline.drafter.model import Drafter
    from stages.train.dataset import StoreBatches
    from stages.train.samples import index_samples
    from stages.train.setup import drafter_config
    from stages.train.step import LossPlan
    from store.hidden_store import HiddenStore

    monkeypatch.setattr(attention, "compiled_flex", lambda: flex_attention)
    store = HiddenStore(str(small_store))
    config = TrainConfig.of(anchors=6, num_layers=2, batching="packed", **over)
    dc, _ = drafter_config(config, store.attrs, None)
    model = Drafter(dc, store.embedding("embed_tokens").float(), store.embedding("lm_head").float()).eval()
    model.init_weights(torch.Generator().manual_seed(0), std=0.1)
    refs = index_samples(store, [0, 1], 60)[:3]
    plan = LossPlan.of(config.loss, dc, flex, packed=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packed, seen = recorded_forward(model, StoreBatches(str(small_store), [[tuple(refs)]])[0], plan, monkeypatch)
        anchors, valid = seen["anchors"]
        at, total = 0, torch.zeros_like(packed.sums)
        for r in refs:
            mine = valid[0] & (anchors[0] >= at) & (anchors[0] < at + r.length)
            own = (anchors[:, mine] - at, valid[:, mine])
            alone, got = recorded_forward(model, StoreBatches(str(small_store), [[(r,)]])[0], plan, monkeypatch, own)
            n = int(mine.sum())
            sel = torch.nn.functional.pad(mine, (0, seen["labels"].shape[1] - len(mine)))  # flex pads the anchors
            assert n > 0 and torch.equal(got["labels"][0, :n], seen["labels"][0, sel])
            keep = got["labels"][0, :n] != IGNORE  # [n, B]
            B = dc.block_size
            h_alone = got["h"][0].view(-1, B, dc.hidden_size)[:n][keep]
            h_packed = seen["h"][0].view(-1, B, dc.hidden_size)[sel][keep]
            assert torch.allclose(h_alone, h_packed, atol=1e-5)
            total += alone.sums
            at += r.length
    assert torch.allclose(total, packed.sums, rtol=1e-5)
    assert int(total[3]) == int(valid.sum())  # every block belongs to exactly one sample


def test_label_normalisation_divides_by_the_number_of_labels(small_store):
    import torch

    from pipeline.drafter.model import Drafter
    from stages.train.dataset import StoreBatches
    from stages.train.samples import index_samples
    from stages.train.setup import drafter_config
    from stages.train.step import LossPlan, forward_loss, step_generator
    from store.hidden_store import HiddenStore

    store = HiddenStore(str(small_store))
    dc, _ = drafter_config(TrainConfig.of(num_layers=1), store.attrs, None)
    model = Drafter(dc, store.embedding("embed_tokens").float(), store.embedding("lm_head").float()).eval()
    model.init_weights(torch.Generator().manual_seed(0))
    batch = StoreBatches(str(small_store), [[(r,) for r in index_samples(store, [0], 200)[:2]]])[0]
    outs = {
        norm: forward_loss(
            model,
            model,
            batch,
            LossPlan.of(LossConfig(anchors=8, loss_norm=norm), dc, False),
            step_generator(0, 1, 0, 0, torch.device("cpu")),
        )
        for norm in ("weights", "labels")
    }
    sums = outs["weights"].sums
    labels = float(sums[5 + dc.block_size :].sum())
    assert torch.equal(sums, outs["labels"].sums)  # same anchors, same statistics
    assert torch.allclose(outs["weights"].loss, sums[0] / sums[1])
    assert torch.allclose(outs["labels"].loss, sums[0] / labels)


def test_uniform_noise_is_bounded_by_its_half_width():
    import torch

    from stages.train.step import LossPlan, make_noise

    g = torch.Generator().manual_seed(0)
    plan = LossPlan(8, 16, 0, 7.0, 0.05, False, noise="uniform")
    x = make_noise(plan, (4000,), g, "cpu")
    assert 0.049 < float(x.abs().max()) <= 0.05 and abs(float(x.std()) - 0.05 / 3**0.5) < 2e-3
    y = make_noise(LossPlan(8, 16, 0, 7.0, 0.05, False), (4000,), g, "cpu")
    assert abs(float(y.std()) - 0.05) < 3e-3 and float(y.abs().max()) > 0.1  # Gaussian: sd 0.05, tails beyond it


def test_the_acceptance_weight_reaches_the_loss_and_leaves_the_metrics(small_store):
    """--acceptance-weight mixes 1 - E/(B-1) into the step's loss: 0 is the weighted CE (sums[0] /
    sums[1]), 1 a value in (0, 1), 0.5 their mean; the metrics' sums are the same for all three."""
    import torch

    from pipeline.drafter.model import Drafter
    from stages.train.dataset import StoreBatches
    from stages.train.samples import index_samples
    from stages.train.setup import drafter_config
    from stages.train.step import LossPlan, forward_loss, step_generator
    from store.hidden_store import HiddenStore

    store = HiddenStore(str(small_store))
    dc, _ = drafter_config(TrainConfig.of(num_layers=1), store.attrs, None)
    model = Drafter(dc, store.embedding("embed_tokens").float(), store.embedding("lm_head").float()).eval()
    model.init_weights(torch.Generator().manual_seed(0))
    batch = StoreBatches(str(small_store), [[(r,) for r in index_samples(store, [0], 200)[:2]]])[0]
    plans = {lam: LossPlan.of(LossConfig(anchors=8, acceptance_weight=lam), dc, False) for lam in (0.0, 0.5, 1.0)}
    assert [p.acceptance for p in plans.values()] == [0.0, 0.5, 1.0]
    outs = {
        lam: forward_loss(model, model, batch, plan, step_generator(0, 1, 0, 0, torch.device("cpu")))
        for lam, plan in plans.items()
    }
    sums = outs[0.0].sums
    assert all(torch.equal(out.sums, sums) for out in outs.values())
    assert torch.allclose(outs[0.0].loss, sums[0] / sums[1])
    assert 0 < outs[1.0].loss.item() < 1 and not torch.allclose(outs[1.0].loss, outs[0.0].loss)
    assert torch.allclose(outs[0.5].loss, (outs[0.0].loss + outs[1.0].loss) / 2)


def test_the_losss_chunk_is_compute_bound_on_a_gpu_and_small_elsewhere(small_store, monkeypatch):
    """At the 27B vocabulary a GPU chunk holds 1,081 rows (1 GiB of fp32 logits: about 662 FLOP a byte
    against an H100's ridge of 295), a CPU chunk 270 (256 MiB); forward_loss passes the device's."""
    import torch

    import stages.train.step as st

    assert st.loss_chunk_rows(248_320, torch.device("cuda")) == 1081
    assert st.loss_chunk_rows(248_320, torch.device("cpu")) == 270
    rows = 1081
    assert rows * 5120 / (5120 + 3 * rows) > 2 * 295 > 2 * 270 * 5120 / (5120 + 3 * 270)
    from pipeline.drafter.loss import rows_within
    from pipeline.drafter.model import Drafter
    from stages.train.dataset import StoreBatches
    from stages.train.samples import index_samples
    from stages.train.setup import drafter_config
    from store.hidden_store import HiddenStore

    store = HiddenStore(str(small_store))
    config = TrainConfig.of(anchors=4, num_layers=1)
    dc, _ = drafter_config(config, store.attrs, None)
    model = Drafter(dc, store.embedding("embed_tokens").float(), store.embedding("lm_head").float()).eval()
    seen, real = [], st.dflash_loss
    monkeypatch.setattr(st, "dflash_loss", lambda *a, **k: seen.append(k["chunk_rows"]) or real(*a, **k))
    batch = StoreBatches(str(small_store), [[(index_samples(store, [0], 60)[0],)]])[0]
    with torch.no_grad():
        st.forward_loss(
            model, model, batch, st.LossPlan.of(config.loss, dc, False), st.step_generator(0, 1, 0, 0, "cpu")
        )
    assert seen == [rows_within(model.lm_head.shape[0])]


def test_the_expected_acceptance_term_is_refused_with_the_dspark_head():
    from stages.train.step import LossPlan
    from tests.drafters import config

    assert LossPlan.of(LossConfig(), config(head="dspark"), flex=False).acceptance == 0
    with pytest.raises(ConfigError, match=r"--acceptance-weight 0.5: is not used with --head dspark"):
        LossPlan.of(LossConfig(acceptance_weight=0.5), config(head="dspark"), flex=False)
    assert LossPlan.of(LossConfig(acceptance_weight=0.5), config(), flex=False).acceptance == 0.5


def test_a_bad_head_or_rank_is_named():
    from stages.train.config import DrafterArchConfig

    with pytest.raises(ConfigError, match="--head medusa: expected one of dflash, dspark"):
        DrafterArchConfig(head="medusa")
    with pytest.raises(ConfigError, match="--markov-rank 0"):
        DrafterArchConfig(markov_rank=0)


def test_soft_targets_see_the_final_state_that_predicted_each_slots_token(final_store, monkeypatch):
    """The step hands the loss, for each slot, the stored final state of the position before it: on a greedy
    store the target's argmax there is the slot's label (the reference token); one position later it is not."""
    import torch

    import stages.train.step as st
    from pipeline.drafter.blocks import IGNORE
    from pipeline.drafter.model import Drafter
    from stages.train.dataset import StoreBatches
    from stages.train.samples import index_samples
    from stages.train.setup import drafter_config
    from store.hidden_store import HiddenStore
    from store.shard_reader import ShardReader

    store = HiddenStore(str(final_store))
    config = TrainConfig.of(num_layers=1, soft_targets="kl")
    dc, _ = drafter_config(config, store.attrs, None)
    model = Drafter(dc, store.embedding("embed_tokens").float(), store.embedding("lm_head").float()).eval()
    refs = index_samples(store, [0], 400)[:3]
    batch = StoreBatches(str(final_store), [[(r,) for r in refs]], final_state=True)[0]
    for j, r in enumerate(refs):
        sample = ShardReader(store, r.shard).read(r.index, final_state=True)
        assert torch.equal(batch.final[j, : r.length], sample.final_state[: r.length])
    seen, real = {}, st.dflash_loss
    monkeypatch.setattr(st, "dflash_loss", lambda *a, **k: seen.update(labels=a[1], **k) or real(*a, **k))
    with torch.no_grad():
        plan = st.LossPlan.of(config.loss, dc, False)
        st.forward_loss(model, model, batch, plan, st.step_generator(0, 1, 0, 0, torch.device("cpu")))
    keep = seen["labels"] != IGNORE
    top = model.logits(seen["target"][keep].float()).argmax(-1)
    assert seen["soft"] == "kl" and (top == seen["labels"][keep]).float().mean() > 0.9
    both = keep[..., :-1] & keep[..., 1:]
    own = seen["target"][..., 1:, :][both]  # slot k's own position's state (the one before slot k + 1)
    assert (model.logits(own.float()).argmax(-1) == seen["labels"][..., :-1][both]).float().mean() < 0.5


def test_soft_targets_are_checked_against_the_weights_and_the_head():
    from stages.train.step import LossPlan
    from tests.drafters import config

    with pytest.raises(ConfigError, match=r"--acceptance-weight 0.5: is the hard-label form of --soft-targets accept"):
        LossConfig(acceptance_weight=0.5, soft_targets="accept")
    with pytest.raises(ConfigError, match=r"--soft-weight 0.0: expected 0 < weight <= 1"):
        LossConfig(soft_targets="kl", soft_weight=0.0)
    with pytest.raises(ConfigError, match=r"--soft-targets kl: a dspark drafter takes tv"):
        LossPlan.of(LossConfig(soft_targets="kl"), config(head="dspark"), flex=False)
    plan = LossPlan.of(LossConfig(soft_targets="tv", soft_weight=0.25), config(), flex=False)
    assert (plan.soft, plan.soft_weight) == ("tv", 0.25)


def test_soft_targets_train_through_loader_workers_and_are_recorded(final_store, small_store, tmp_path):
    from pipeline.drafter import checkpoint
    from stages.train.run import run

    def config(store, out, **over):
        fields = dict(max_steps=12, save_every=0, log_every=1, workers=1, threads=1, num_layers=1, anchors=16)
        return TrainConfig.of(store=str(store), out=str(tmp_path / out), batch_size=2, **fields, **over)

    with pytest.raises(
        ConfigError, match=r"--soft-targets kl: .*holds no final states.*pipeline extract --final-state"
    ):
        run(config(small_store, "refused", soft_targets="kl"), log=lambda m: None)
    run(config(final_store, "run", soft_targets="kl", soft_weight=0.7), log=lambda m: None)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert len(train) == 12 and train[-1]["ce"] < train[0]["ce"] - 0.5  # it learns the reference tokens too
    _, _, record = checkpoint.load(tmp_path / "run" / "final")
    assert (record.train_config["soft_targets"], record.train_config["soft_weight"]) == ("kl", 0.7)
