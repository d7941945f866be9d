"""Stage two end to end: resume equals straight, real 2-process DDP, checkpoints, one-line errors."""

import dataclasses
import json
import math
import shutil
import sys

import pytest
import torch

from pipeline.drafter import checkpoint
from store.errors import UserError
from tests.processes import TINY, cpu_ddp, losses, train

OPTIONS = [
    "--optimizer",
    "adamw",
    "--schedule",
    "linear",
    "--batching",
    "packed",
    "--max-length",
    160,
    "--noise",
    "uniform",
    "--slot-weights",
    "exp",
    "--loss-norm",
    "labels",
    "--anchor-rule",
    "single",
]


@pytest.mark.parametrize(
    "recipe",
    [[], OPTIONS, ["--acceptance-weight", 0.5], ["--head", "dspark", "--markov-rank", 8]],
    ids=["defaults", "options", "acceptance", "dspark"],
)
def test_resume_equals_uninterrupted(small_store, tmp_path, recipe):
    """The defaults (Muon's and AdamW's states, random batches, D-PACE) and every other option (AdamW alone, the
    linear schedule, packed epochs, uniform noise, exp weights, label normalisation, single anchors, the
    expected-acceptance term mixed in, the dspark head and its objective) resume exactly."""
    common = ["--store", small_store, "--max-steps", 20, "--save-every", 10, "--noise-std", 0.05, *TINY, *recipe]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    r = train([*common, "--out", straight])
    assert r.returncode == 0, r.stderr
    r = train([*common, "--out", resumed], stop_after=10)
    assert r.returncode == 130
    assert r.stderr.splitlines()[-1] == "error: interrupted; rerun with --resume to continue from the last step-N"
    assert (resumed / "step-10").is_dir() and not (resumed / "final").exists() and len(losses(resumed)) == 10
    r = train([*common, "--out", resumed, "--resume"])
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stderr
    assert losses(resumed) == losses(straight) and len(losses(straight)) == 20
    a, b = checkpoint.load(straight / "final")[1], checkpoint.load(resumed / "final")[1]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert losses(straight)[-1] < losses(straight)[0] - 1.0  # it learns
    assert ("markov_head.markov_w2.weight" in a) == ("dspark" in recipe)


def test_a_checkpoint_in_accelerates_layout_still_resumes(small_store, tmp_path):
    """step-2 written as runs wrote it before the trainer state (Accelerate's save_state: model,
    optimizers, schedules, RNG) resumes as exactly as the trainer state does; the resumed run's
    step-4 is then in the trainer state's layout."""
    common = ["--store", small_store, "--max-steps", 4, "--save-every", 2, *TINY]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train([*common, "--out", straight]).returncode == 0
    r = train(["--accelerate-layout", *common, "--out", resumed], stop_after=2)
    assert r.returncode == 130, r.stderr
    assert (resumed / "step-2" / "training" / "model.safetensors").exists()
    assert not (resumed / "step-2" / "training" / ".metadata").exists()
    r = train([*common, "--out", resumed, "--resume"])
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr
    assert losses(resumed) == losses(straight)
    a, b = checkpoint.load(straight / "final")[1], checkpoint.load(resumed / "final")[1]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (resumed / "step-4" / "training" / ".metadata").exists()


def test_a_step_without_trainer_state_is_refused_in_one_line(small_store, tmp_path):
    common = ["--store", small_store, "--max-steps", 4, "--save-every", 2, *TINY]
    out = tmp_path / "run"
    assert train([*common, "--out", out], stop_after=2).returncode == 130
    training = out / "step-2" / "training"
    shutil.rmtree(training)
    training.mkdir()
    r = train([*common, "--out", out, "--resume"])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == (
        f"error: --resume {training}: holds no trainer state (neither .metadata nor model.safetensors); "
        "resume from another step-N, or start the run over in another --out"
    )


def test_checkpoints_are_released_layout_with_provenance(small_store, tmp_path):
    from store.hidden_store import HiddenStore

    r = train(
        [
            "--store",
            small_store,
            "--out",
            tmp_path / "run",
            "--max-steps",
            4,
            "--save-every",
            2,
            "--shards",
            "0-2",
            "--eval-shards",
            "3",
            *TINY,
        ]
    )
    assert r.returncode == 0, r.stderr
    for d in ("step-2", "step-4", "final"):
        config, tensors, record = checkpoint.load(tmp_path / "run" / d)
        assert record.store_fingerprint == HiddenStore(str(small_store)).attrs.fingerprint
        assert record.train_shards == "0-2" and record.eval_shards == "3"
        assert record.store_placement == HiddenStore(str(small_store)).attrs.compat.placement()
    assert (tmp_path / "run" / "step-2" / "training").is_dir() and not list((tmp_path / "run").glob(".*"))
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals if e["split"] == "eval"] == [0, 4]
    assert "held-out loss" in r.stdout
    epoch = {e["step"]: e["epoch"] for e in evals if e["split"] == "train"}  # --max-steps 4: far short of --epochs 6
    for d, step in (("step-2", 2), ("final", 4)):
        assert checkpoint.load(tmp_path / "run" / d)[2].epochs == epoch[step] < 1, d


def test_two_process_ddp_on_cpu(small_store, tmp_path):
    """Real DDP on 2 processes, the gradients all-reduced in fp32 and in bf16 (--grad-comm): each
    optimizer step all-reduces every trainable gradient once (not once per micro-batch), 4 or 2
    bytes each, and broadcasts Muon's updates, as the metrics log counts them; both processes end
    with the same parameters."""
    launcher = cpu_ddp(2, 29571)
    hashes = {}
    for comm, size in (("fp32", 4), ("bf16", 2)):
        out = tmp_path / comm
        r = train(
            [
                "--store",
                small_store,
                "--out",
                out,
                "--max-steps",
                3,
                "--audit",
                "--grad-comm",
                comm,
                *TINY,
                "--grad-accum",
                2,
                "--batch-size",
                1,
            ],
            launcher=launcher,
        )  # 12 of the 14 samples: one epoch
        assert r.returncode == 0, r.stderr
        ranks = [json.loads((out / "audit" / f"rank-{i}.json").read_text()) for i in (0, 1)]
        assert [x["world_size"] for x in ranks] == [2, 2]
        assert ranks[0]["param_sha256"] == ranks[1]["param_sha256"]  # gradients were all-reduced
        seen = [{tuple(s) for s in x["samples"]} for x in ranks]
        assert seen[0] and seen[1] and not seen[0] & seen[1]  # each rank read its own part
        tensors = checkpoint.load(out / "final")[1]
        trainable, matrices = (
            sum(v.numel() for v in tensors.values()),
            sum(v.numel() for v in tensors.values() if v.dim() == 2),
        )
        steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [m["grad_comm_bytes_per_step"] for m in steps if m["split"] == "train"] == [trainable * size] * 3
        # Muon's updates of the matrices (Newton-Schulz in fp32 on CPU), each broadcast by its owner
        assert [m["muon_broadcast_bytes_per_step"] for m in steps if m["split"] == "train"] == [matrices * 4] * 3
        assert f"gradients all-reduced in {comm}, {trainable * size / 1e9:.3g} GB a step" in r.stdout + r.stderr
        hashes[comm] = ranks[0]["param_sha256"]
    assert hashes["fp32"] != hashes["bf16"]  # the bf16 sum rounded: it really ran


def test_a_dspark_drafter_with_soft_targets_on_two_processes(final_store, tmp_path):
    """The dspark head with soft TV (each batch carrying final states) under real DDP on 2 processes: both
    ranks end with the same parameters, the Markov and confidence heads' gradients among those all-reduced;
    with --markov-optimizer adamw Muon broadcasts every matrix but the two Markov ones."""
    out = tmp_path / "run"
    flags = ["--head", "dspark", "--markov-rank", "8", "--soft-targets", "tv", "--markov-optimizer", "adamw"]
    args = ["--store", final_store, "--out", out, "--max-steps", 2, "--audit", *flags, *TINY, "--batch-size", 1]
    r = train(args, launcher=cpu_ddp(2, 29576))
    assert r.returncode == 0, r.stderr
    ranks = [json.loads((out / "audit" / f"rank-{i}.json").read_text()) for i in (0, 1)]
    assert [x["world_size"] for x in ranks] == [2, 2]
    assert ranks[0]["param_sha256"] == ranks[1]["param_sha256"]
    tensors = checkpoint.load(out / "final")[1]
    markov = {k for k in tensors if k.startswith("markov_head.")}
    assert len(markov) == 2 and any(k.startswith("confidence_head.") for k in tensors)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in records if m["split"] == "train"]
    muon = sum(v.numel() for k, v in tensors.items() if v.dim() == 2 and min(v.shape) > 1 and k not in markov)
    assert [m["grad_comm_bytes_per_step"] for m in steps] == [sum(v.numel() for v in tensors.values()) * 2] * 2
    assert [m["muon_broadcast_bytes_per_step"] for m in steps] == [muon * 4] * 2


def test_a_run_resumes_on_another_number_of_processes(small_store, tmp_path):
    """Interrupted after step-4 on 2 processes, resumed on 1 and interrupted after step-6, resumed on
    2 to the end: each part goes on from the saved step with the schedule (every later step's
    learning rate is the uninterrupted curve's), and the last reads only samples of the epoch the
    earlier parts had not read."""
    from stages.train.config import DataConfig, OptimConfig
    from stages.train.optim import lr_lambda
    from stages.train.position import Position, advance, rank_batches
    from stages.train.samples import index_samples
    from store.hidden_store import HiddenStore

    # one sample a step: the 14 samples make an epoch of 14 steps on one process, 7 on two
    common = ["--store", small_store, "--max-steps", 8, "--save-every", 2, "--audit", *TINY, "--batch-size", 1]
    out = tmp_path / "run"
    r = train([*common, "--out", out], launcher=cpu_ddp(2, 29581), stop_after=4)
    assert r.returncode != 0 and (out / "step-4").is_dir() and not (out / "final").exists(), r.stderr
    files = {p.name: p.stat().st_size for p in (out / "step-4" / "training").iterdir()}
    assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each rank wrote its share
    assert max(files["__0_0.distcp"], files["__1_0.distcp"]) < 1.5 * min(files["__0_0.distcp"], files["__1_0.distcp"])
    r = train([*common, "--out", out, "--resume"], stop_after=6)
    assert r.returncode == 130 and "at step 4 (saved on 2 processes)" in r.stderr, r.stderr
    r = train([*common, "--out", out, "--resume"], launcher=cpu_ddp(2, 29582))
    assert r.returncode == 0 and "at step 6 (saved on 1 processes)" in r.stderr, r.stderr
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    lrs = {x["step"]: x["lr"] for x in records if x["split"] == "train"}
    f = lr_lambda(8, OptimConfig().warmup_ratio)
    assert sorted(lrs) == list(range(1, 9))
    assert all(math.isclose(lrs[k], lrs[1] / f(1) * f(k), rel_tol=1e-9) for k in range(5, 9))
    audits = [json.loads((out / "audit" / f"rank-{i}.json").read_text()) for i in range(2)]
    assert [a["world_size"] for a in audits] == [2, 2]
    config = DataConfig(store=str(small_store), batch_size=1)
    refs = index_samples(HiddenStore(str(small_store)), list(range(4)), config.max_length)
    at4 = advance(config, refs, Position(), 4, 2)
    earlier = [rank_batches(config, refs, Position(), 0, r, 2)[:4] for r in range(2)]
    earlier.append(rank_batches(config, refs, at4, 0, 0, 1)[:2])
    earlier = {(x.shard, x.index) for part in earlier for b in part for row in b for x in row}
    later = [tuple(x) for a in audits for x in a["samples"]]
    assert len(refs) == 14 and len(earlier) == 10
    assert len(later) == len(set(later)) == 4 and not set(later) & earlier  # all four in epoch 0


def setup_error(small_store, tmp_path, **over) -> str:
    from stages.train.config import TrainConfig
    from stages.train.setup import prepare

    with pytest.raises(UserError) as e:
        prepare(TrainConfig.of(store=str(small_store), out=str(tmp_path / "x"), **over), log=lambda m: None)
    return str(e.value)


def test_default_shards_are_the_committed_ones_not_held_out(small_store):
    """Without --shards, training takes every committed shard but the held-out ones: no overlap to refuse."""
    from stages.train.config import DataConfig
    from stages.train.setup import select_shards
    from store.hidden_store import HiddenStore

    store = HiddenStore(str(small_store))
    config = DataConfig(store=str(small_store), eval_shards="1,3")
    assert select_shards(store, config, store.committed()) == ([0, 2], [1, 3])


def test_store_without_lm_head(small_store, tmp_path):
    broken = tmp_path / "broken.zarr"
    shutil.copytree(small_store, broken)
    shutil.rmtree(broken / "target" / "lm_head")
    assert f"{broken}/target/lm_head/zarr.json: missing" in setup_error(broken, tmp_path)


@pytest.mark.parametrize(
    "over,needle",
    [
        ({"shards": "0-9"}, "reaches shard 9, but the store has 4 shards"),
        ({"eval_shards": "0-3"}, "no training shards"),
        (
            {"shards": "0-2", "eval_shards": "2-3"},
            "--shards 0-2: shard 2 is also in --eval-shards 2-3: a held-out shard cannot be trained on",
        ),
        ({"shards": "all", "eval_shards": "2-3"}, "--shards all: shards 2-3 are also in --eval-shards 2-3"),
        ({"shards": " "}, "--shards ' ': is empty"),
        ({"mask_token_id": 99999}, "mask_token_id 99999 is outside the vocabulary"),
        ({"block_size": 12, "slot_weights": "exp"}, "no default loss decay"),
        ({"layer_types": "full,sliding"}, "--layer-types"),
    ],
)
def test_bad_input_is_named(small_store, tmp_path, over, needle):
    assert needle in setup_error(small_store, tmp_path, **over)


def test_init_from_must_fit_the_store(small_store, tmp_path):
    from tests.drafters import config, drafter

    m = drafter(config(hidden_size=32))
    checkpoint.save(tmp_path / "other", m.config, m.state_dict())
    msg = setup_error(small_store, tmp_path, init_from=str(tmp_path / "other"))
    assert "target_layer_ids (taps): drafter has [1, 3], store has [1, 2, 3, 4, 5]" in msg
    assert "hidden_size: drafter has 32, store has 128" in msg


def test_init_from_refuses_a_head_it_would_not_give(small_store, tmp_path):
    from tests.drafters import config, drafter

    m = drafter(config())
    checkpoint.save(tmp_path / "dflash", m.config, m.state_dict())
    msg = setup_error(small_store, tmp_path, init_from=str(tmp_path / "dflash"), head="dspark")
    assert msg.startswith("--head dspark: ") and "is a drafter with head dflash, and --init-from keeps" in msg


def test_cli_error_is_one_line(tmp_path):
    r = train(["--store", tmp_path / "nope.zarr", "--out", tmp_path / "o"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: ")
    assert "not a hidden-state store" in r.stderr
    assert not (tmp_path / "o").exists()  # no empty --out left behind


def test_a_failed_run_removes_the_out_it_created_and_only_that(small_store, tmp_path):
    """The README's second command run after its 8-shard set-up (held-out shards the store lacks), or a
    store that is not there: the run fails, and leaves no empty runs/a (nor runs/) for the next run or
    the user to take for a run. A directory that was there before stays, empty as it was."""
    from stages.train.config import TrainConfig
    from stages.train.run import run

    (tmp_path / "there").mkdir()
    for store, out, over in [
        (small_store, tmp_path / "runs" / "a", {"eval_shards": "60-63"}),
        (tmp_path / "nope.zarr", tmp_path / "runs" / "b", {}),
        (small_store, tmp_path / "there", {"eval_shards": "60-63"}),
    ]:
        with pytest.raises(UserError):
            run(TrainConfig.of(store=str(store), out=str(out), **over), log=lambda m: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["there"] and not any((tmp_path / "there").iterdir())


def test_noise_touches_only_the_fc_input(small_store, monkeypatch):
    import stages.train.step as st
    from pipeline.drafter.model import Drafter
    from stages.train.config import LossConfig, TrainConfig
    from stages.train.dataset import StoreBatches
    from stages.train.samples import index_samples
    from stages.train.setup import drafter_config
    from stages.train.step import LossPlan, forward_loss, step_generator
    from store.hidden_store import HiddenStore

    store = HiddenStore(str(small_store))
    dc, _ = drafter_config(TrainConfig.of(num_layers=1), store.attrs, None)
    model = Drafter(dc, store.embedding("embed_tokens").float(), store.embedding("lm_head").float())
    model.init_weights(torch.Generator().manual_seed(0))
    batch = StoreBatches(str(small_store), [[(r,) for r in index_samples(store, [0, 1], 200)[:2]]])[0]
    hidden_before = batch.hidden.clone()
    seen = {}
    real_loss = st.dflash_loss
    monkeypatch.setattr(
        st,
        "dflash_loss",
        lambda h, labels, *a, **k: seen.setdefault("labels", []).append(labels) or real_loss(h, labels, *a, **k),
        raising=True,
    )
    model.fc.register_forward_pre_hook(lambda m, a: seen.setdefault("fc_in", []).append(a[0].clone()))
    model.layers[0].register_forward_pre_hook(lambda m, a: seen.setdefault("x", []).append(a[0].clone()))
    losses_ = [
        forward_loss(
            model,
            model,
            batch,
            LossPlan.of(LossConfig(noise_std=std, anchors=8), dc, flex=False),
            step_generator(0, 3, 0, 0, torch.device("cpu")),
        ).loss
        for std in (0.0, 0.5)
    ]
    assert torch.equal(seen["labels"][0], seen["labels"][1])  # labels: from tokens, untouched
    assert torch.equal(seen["x"][0], seen["x"][1])  # block inputs (target embeddings of tokens): untouched
    assert torch.equal(batch.hidden, hidden_before)  # no in-place change of the stored states
    diff = seen["fc_in"][1] - seen["fc_in"][0]
    assert 0.4 < float(diff.std()) < 0.6 and losses_[0] != losses_[1]


def test_out_holding_a_run_needs_resume(small_store, tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "metrics.jsonl").write_text("")
    assert "already holds a run (metrics.jsonl); pass --resume" in setup_error(small_store, tmp_path)


def test_drafter_config_gives_the_whole_architecture(small_store, tmp_path):
    from stages.train.config import DrafterArchConfig
    from stages.train.setup import fresh_config
    from store.hidden_store import HiddenStore
    from tests.drafters import RELEASED_27B

    (tmp_path / "config.json").write_text(json.dumps(RELEASED_27B))
    attrs = HiddenStore(str(small_store)).attrs
    c = fresh_config(DrafterArchConfig(drafter_config=str(tmp_path / "config.json")), 16, attrs)
    assert c.layer_types == ("sliding_attention",) * 4 + ("full_attention",) and c.sliding_window == 2048
    assert c.rope_parameters["rope_theta"] == 1e7 and (c.num_attention_heads, c.num_key_value_heads) == (32, 8)
    assert c.hidden_size == 128 and c.target_layer_ids == attrs.taps and c.mask_token_id == attrs.mask_token_id
    c2 = fresh_config(
        DrafterArchConfig(
            drafter_config=str(tmp_path / "config.json"),
            num_layers=2,
            num_heads=4,
            head_dim=32,
            intermediate_size=256,
            layer_types="sliding,full",
            rope_theta=1e4,
        ),
        16,
        attrs,
    )
    assert c2.layer_types == ("sliding_attention", "full_attention") and c2.rope_parameters["rope_theta"] == 1e4


def test_the_default_drafter_is_one_vllm_serves_beside_the_stores_target(small_store, tmp_path):
    """The tiny target: 2 full-attention layers (2 KV heads x 32) beside 6 linear ones. heads / 4 = 1 KV
    head would put the drafter's 5 layers in 3 of vLLM's KV-cache groups (refused); the default takes
    the target's layout. A layout the user chose is kept, and setup says vLLM will refuse it."""
    from pipeline.drafter.serving_engines import vllm_kv_problem
    from stages.train.config import DrafterArchConfig, TrainConfig
    from stages.train.setup import fresh_config, prepare
    from store.hidden_store import HiddenStore

    attrs = HiddenStore(str(small_store)).attrs
    assert (attrs.target.num_key_value_heads, attrs.target.head_dim) == (2, 32)
    c = fresh_config(DrafterArchConfig(), 16, attrs)
    assert (c.num_key_value_heads, c.head_dim, c.num_attention_heads) == (2, 32, 4)
    assert vllm_kv_problem(c, attrs.target) is None
    chosen = fresh_config(DrafterArchConfig(num_kv_heads=1), 16, attrs)
    assert chosen.num_key_value_heads == 1 and vllm_kv_problem(chosen, attrs.target)

    class Warned(Exception):
        pass

    def log(line):  # stop setup at its first warning, before it builds anything
        if line.startswith("warning"):
            raise Warned(line)

    with pytest.raises(Warned, match=r"vLLM will refuse this drafter.*--num-kv-heads 2 --head-dim 32"):
        prepare(TrainConfig.of(store=str(small_store), out=str(tmp_path / "x"), num_kv_heads=1), log=log)


def test_validation_checks_a_fixed_sample_through_the_loader(small_store, tmp_path):
    """--eval-samples: a seeded sample, the same on every call; every eval record gives its size; 'all'
    is every held-out sample."""
    from stages.train.samples import index_samples, sample_refs
    from store.hidden_store import HiddenStore

    held_out = index_samples(HiddenStore(str(small_store)), [2, 3], 4096)
    assert sample_refs(held_out, 3, 0) == sample_refs(held_out, 3, 0) != sample_refs(held_out, 3, 1)
    assert len(set(sample_refs(held_out, 3, 0))) == 3 and sample_refs(held_out, None, 0) == held_out
    for n, want in (("3", 3), ("all", len(held_out))):
        out = tmp_path / n
        r = train(
            [
                "--store",
                small_store,
                "--out",
                out,
                "--max-steps",
                2,
                "--eval-shards",
                "2-3",
                "--eval-samples",
                n,
                "--eval-every",
                1,
                *TINY,
            ]
        )
        assert r.returncode == 0, r.stderr
        evals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [e["samples"] for e in evals if e["split"] == "eval"] == [want] * 3


def test_init_from_a_config_without_num_target_layers_gets_the_stores(small_store, tmp_path):
    """Consumers (the reference implementation, SGLang) need num_target_layers: a run started from a
    released config that lacks it writes the store's."""
    from store.hidden_store import HiddenStore
    from tests.drafters import write_released

    attrs = HiddenStore(str(small_store)).attrs
    released = tmp_path / "released"
    write_released(released, attrs.hidden_size, attrs.vocab_size, list(attrs.taps), attrs.mask_token_id)
    cfg = json.loads((released / "config.json").read_text())
    del cfg["num_target_layers"]
    (released / "config.json").write_text(json.dumps(cfg))
    r = train(["--store", small_store, "--out", tmp_path / "run", "--max-steps", 1, "--init-from", released, *TINY])
    assert r.returncode == 0, r.stderr
    written = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert written["num_target_layers"] == attrs.num_layers
    assert written["max_position_embeddings"] == attrs.target.max_position_embeddings == 4096  # not 40960


def test_a_fresh_drafter_takes_the_targets_context_length(small_store):
    from stages.train.config import TrainConfig
    from stages.train.setup import drafter_config, with_target_facts
    from store.hidden_store import HiddenStore

    attrs = HiddenStore(str(small_store)).attrs
    dc, _ = drafter_config(TrainConfig.of(), attrs, None)
    assert dc.max_position_embeddings == 4096 and dc.num_target_layers == attrs.num_layers
    yarn = dataclasses.replace(
        dc, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0}, max_position_embeddings=40960
    )
    assert with_target_facts(yarn, attrs).max_position_embeddings == 40960  # a scaled RoPE keeps its own


def test_a_drafter_with_an_embedding_scale_is_warned_about(small_store, tmp_path):
    from stages.train.config import TrainConfig
    from stages.train.setup import prepare
    from store.hidden_store import HiddenStore
    from tests.drafters import write_released

    attrs = HiddenStore(str(small_store)).attrs
    write_released(tmp_path / "rel", attrs.hidden_size, attrs.vocab_size, list(attrs.taps), attrs.mask_token_id)
    d = json.loads((tmp_path / "rel" / "config.json").read_text())
    d["dflash_config"]["input_embedding_scale"] = 0.5
    (tmp_path / "rel" / "config.json").write_text(json.dumps(d))
    lines = []
    prepare(
        TrainConfig.of(
            store=str(small_store), out=str(tmp_path / "x"), drafter_config=str(tmp_path / "rel"), workers=0
        ),
        log=lines.append,
    )
    assert any("input_embedding_scale 0.5: no serving consumer applies it" in x for x in lines)


def test_a_corrupt_chunk_stops_training_naming_it_or_is_skipped_and_counted(store_copy, tmp_path):
    from stages.train.config import TrainConfig
    from stages.train.run import done_line
    from stages.train.run import run as train_run
    from store.errors import StoreCorrupt
    from tests.conftest import damage_states

    damage_states(store_copy, 1)
    common = dict(store=str(store_copy), eval_shards="3", max_steps=4, batch_size=4, anchors=8, workers=0)
    with pytest.raises(StoreCorrupt) as e:
        train_run(TrainConfig.of(out=str(tmp_path / "stop"), **common), log=lambda m: None)
    msg = str(e.value)
    assert "shards/00001/hidden" in msg and "fails its crc32c checksum" in msg and "\n" not in msg
    assert f"pipeline verify {store_copy} --shards 1" in msg and "--shards 1 --redo" in msg
    summary = train_run(TrainConfig.of(out=str(tmp_path / "skip"), on_corrupt="skip", **common), log=lambda m: None)
    assert summary["corrupt_skipped"] > 0 and "corrupt sample(s) left out" in done_line(summary)
    records = [json.loads(x) for x in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert records[-2]["split"] == "train" and records[-2]["corrupt_skipped"] == summary["corrupt_skipped"]
    assert all(math.isfinite(r["loss"]) for r in records)


def test_a_second_trainer_on_the_same_out_is_refused_naming_the_holder(small_store, tmp_path):
    import os
    import subprocess

    from stages.out_contents import RUN_LOCK
    from stages.train.config import TrainConfig
    from stages.train.run import run as train_run
    from store.io.locks import HOST, IDENTITY, LockFile

    lock = tmp_path / "x" / RUN_LOCK
    first = LockFile(lock)
    assert first.try_acquire() is None  # a live run holds OUT
    msg = setup_error(small_store, tmp_path)
    assert f"another training run is writing it (host {HOST}, pid {os.getpid()}, since " in msg
    first.release()
    dead = subprocess.Popen(["true"])
    dead.wait()  # a killed run's lock: its pid is gone, so the next run takes it over
    lock.write_text(json.dumps({"host": HOST, "pid": dead.pid, "identity": IDENTITY, "since": 0}))
    summary = train_run(
        TrainConfig.of(
            store=str(small_store), out=str(tmp_path / "x"), max_steps=1, batch_size=2, anchors=4, workers=0
        ),
        log=lambda m: None,
    )
    assert summary["steps"] == 1 and not lock.exists()  # released at the end


def test_a_non_finite_loss_stops_before_the_weights_naming_step_and_samples(small_store, tmp_path, monkeypatch):
    from pipeline.errors import TrainingError
    from stages.train import run as train_module
    from stages.train.config import TrainConfig

    real, calls = train_module.forward_loss, []

    def poisoned(model, raw, batch, plan, gen, **kw):  # the 3rd training micro-batch's loss becomes NaN
        out = real(model, raw, batch, plan, gen, **kw)
        if model.training:
            calls.append(batch.refs.tolist())
            if len(calls) == 3:
                out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(train_module, "forward_loss", poisoned)
    config = TrainConfig.of(
        store=str(small_store), out=str(tmp_path / "run"), max_steps=5, save_every=2, batch_size=2, anchors=4, workers=0
    )
    with pytest.raises(TrainingError) as e:
        train_module.run(config, log=lambda m: None)
    shard, index = calls[2][0]
    assert f"step 3, micro-batch 0: the loss is nan, not finite; the batch held shard {shard} sample {index}" in str(
        e.value
    )
    assert sorted(p.name for p in (tmp_path / "run").glob("step-*")) == ["step-2"]  # nothing saved after it


def test_the_step_leaves_its_figures_on_the_device_until_a_log_record(small_store, tmp_path, monkeypatch):
    """No read back of the loss statistics a step: train_step hands back device tensors, the window
    adds them on the device and reads them (summarize) only every --log-every steps; the finiteness of
    each loss is checked once, at its optimizer step, before the optimizer runs."""
    from stages.train import run as train_module
    from stages.train.config import TrainConfig

    events, real_step, real_check = [], train_module.train_step, train_module.FiniteLoss.check
    real_summarize = train_module.summarize

    def step(setup, config, batches, n, seen):
        for opt in setup.optimizers:
            if not getattr(opt, "_traced", False):
                inner, opt._traced = opt.step, True
                opt.step = lambda *a, _inner=inner, **k: (events.append("opt"), _inner(*a, **k))[1]
        sums, tokens = real_step(setup, config, batches, n, seen)
        assert isinstance(sums, torch.Tensor) and isinstance(tokens, int)
        events.append("step")
        return sums, tokens

    monkeypatch.setattr(train_module, "train_step", step)
    monkeypatch.setattr(train_module.FiniteLoss, "check", lambda self: (events.append("check"), real_check(self))[1])
    monkeypatch.setattr(train_module, "summarize", lambda s: (events.append("read"), real_summarize(s))[1])
    config = TrainConfig.of(
        store=str(small_store),
        out=str(tmp_path / "run"),
        max_steps=6,
        log_every=3,
        grad_accum=2,
        batch_size=1,
        anchors=4,
        workers=0,
    )
    train_module.run(config, log=lambda m: None)
    # Muon and AdamW called on both micro-batches (Accelerate skips the first); both losses checked
    # at the second, before its optimizers; the figures read once every 3 steps
    per_step = "opt opt check check opt opt step".split()
    assert events == (per_step * 3 + ["read"]) * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's sync debug mode needs a GPU")
def test_a_step_on_a_gpu_never_waits_for_it(small_store, tmp_path, monkeypatch):
    """torch.cuda's sync debug mode raises on any host wait inside the steps after the first two
    (the first compile flex attention)."""
    from stages.train import run as train_module
    from stages.train.config import TrainConfig

    real_step = train_module.train_step

    def step(setup, config, batches, n, seen):
        if n < 2:
            return real_step(setup, config, batches, n, seen)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real_step(setup, config, batches, n, seen)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(train_module, "train_step", step)
    config = TrainConfig.of(
        store=str(small_store), out=str(tmp_path / "run"), max_steps=5, batch_size=1, anchors=4, workers=0
    )
    train_module.run(config, log=lambda m: None)


def test_grad_checkpoint_trains_the_same_drafter(small_store, tmp_path):
    """--grad-checkpoint recomputes the layers in the backward: 3 steps give parameters equal bit for
    bit to the run that keeps the activations."""
    hashes = []
    for extra in ([], ["--grad-checkpoint"]):
        out = tmp_path / ("ckpt" if extra else "kept")
        r = train(
            ["--store", small_store, "--out", out, "--max-steps", 3, "--audit", "--eval-shards", "3", *TINY, *extra]
        )
        assert r.returncode == 0, r.stderr
        hashes.append(json.loads((out / "audit" / "rank-0.json").read_text())["param_sha256"])
        assert json.loads((out / "final" / "config.json").read_text())["dflash_pipeline"]["train_config"][
            "grad_checkpoint"
        ] == bool(extra)
    assert hashes[0] == hashes[1]


def test_an_interrupt_before_the_first_checkpoint_does_not_offer_resume(small_store, tmp_path):
    """Ctrl-C while --follow waits for shards to be committed: nothing was saved, so the last line says to
    rerun, not to --resume (test_resume_equals_uninterrupted: after step-N it does), and no --out is left."""
    import signal
    import subprocess

    from tests.conftest import REPO
    from tests.processes import _default_sigint
    from tests.stages.test_shard_schedule import growing

    store = growing(small_store, tmp_path / "grow.zarr", first=0)  # no shard committed: the run waits
    p = subprocess.Popen(
        [
            sys.executable,
            "train.py",
            "--store",
            str(store),
            "--out",
            str(tmp_path / "run"),
            "--shards",
            "0-3",
            "--max-steps",
            "4",
            "--follow",
            "--follow-poll",
            "0.2",
            *map(str, TINY),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )
    said = [p.stderr.readline()]
    while "too few to begin" not in said[-1] and said[-1]:
        said.append(p.stderr.readline())
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, "".join(said) + err
    assert err.splitlines()[-1] == (
        "error: interrupted before the first checkpoint (step-N) was saved: nothing to "
        "resume; rerun the same command to start again"
    )
    assert not (tmp_path / "run").exists()


def test_an_out_in_a_store_or_holding_another_commands_output_is_refused(small_store, store_copy, tmp_path):
    """--out is a store, lies inside one (refused before torch is imported), or is another command's output (a
    report, a drafter checkpoint): one line saying what it is; nothing is written there."""
    from tests.stages.test_export import tree

    before = tree(store_copy)
    into_a_store = "no command writes its output into a store; choose a directory outside it"
    for out, what in (
        (store_copy / "runs" / "a", f"lies inside the hidden-state store {store_copy}"),
        (store_copy, "is a hidden-state store (zarr.json, shards/, _commits/, ...)"),
    ):
        r = train(["--store", small_store, "--out", out, "--max-steps", 1, *TINY])
        assert (r.returncode, r.stdout, r.stderr) == (2, "", f"error: --out {out}: {what}: {into_a_store}\n")
    assert tree(store_copy) == before
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "report.json").write_text("{}")
    assert setup_error(small_store, tmp_path, max_steps=1) == (
        f"--out {tmp_path / 'x'}: is an evaluate.py report (report.json): train.py writes a run into an empty "
        "directory or its own run; choose another --out"
    )
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["report.json"]  # its lock released


def test_a_run_opens_the_store_once_per_process(small_store, tmp_path, monkeypatch):
    """Setup, the loader and validation (teacher-forced and replayed, at every call) read through one
    HiddenStore in the training process; each loader worker opens its own, once (a forked copy of
    the parent's file system and its sessions is not the worker's to use)."""
    import os

    from stages.train.config import TrainConfig
    from stages.train.run import run
    from store.hidden_store import HiddenStore

    opened, real = tmp_path / "opened", HiddenStore.__init__

    def counting(self, *args, **kw):
        with opened.open("a") as f:  # a loader worker is a forked process: it reports through a file
            f.write(f"{os.getpid()}\n")
        real(self, *args, **kw)

    monkeypatch.setattr(HiddenStore, "__init__", counting)
    run(
        TrainConfig.of(
            store=str(small_store),
            out=str(tmp_path / "run"),
            shards="0-2",
            eval_shards="3",
            eval_replay_prompts=2,
            eval_every=1,
            max_steps=2,
            save_every=0,
            workers=1,
            threads=1,
            num_layers=1,
            anchors=16,
            batch_size=2,
        ),
        log=lambda m: None,
    )
    pids = opened.read_text().split()
    assert pids.count(str(os.getpid())) == 1, pids  # validated at steps 0, 1 and 2, replayed at 1 and 2
    assert len(pids) == len(set(pids)) >= 2, pids  # the workers of the three loaders: each its own, once
