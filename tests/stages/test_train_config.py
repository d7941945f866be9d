"""TrainConfig is made of its components' configs (stages/train/config.py), but a run records it as one
flat {setting: value}: OUT/step-N/trainer_state.json, a drafter's config.json train_config, the
checkpoint card. That record keeps the keys it had when TrainConfig was flat, so old runs resume and
old checkpoints load."""

import json
from pathlib import Path

import pytest

from stages.settings import flag_of, leaves, parts
from stages.train.config import DataConfig, LossConfig, OptimConfig, TrainConfig
from store.errors import ConfigError

# TrainConfig().record() as the flat TrainConfig wrote it (dataclasses.asdict) before the components: keys and defaults.
FLAT_DEFAULTS = {
    "store": "hs.zarr",
    "out": "runs/drafter",
    "shards": None,
    "eval_shards": None,
    "max_steps": None,
    "follow": False,
    "follow_poll": 30.0,
    "shard_schedule": None,
    "epochs": 6,
    "lr": 0.0006,
    "warmup_ratio": 0.04,
    "schedule": "cosine",
    "optimizer": "muon",
    "muon_lr": None,
    "muon_weight_decay": 0.1,
    "grad_clip": 1.0,
    "weight_decay": 0.0,
    "block_size": 16,
    "gamma": None,
    "anchors": 512,
    "anchor_rule": "pair",
    "max_length": 4096,
    "batch_size": 1,
    "batching": "random",
    "grad_accum": 1,
    "data_order": "global",
    "shuffle_window": None,
    "redeal_every": 0,
    "seed": 0,
    "noise_std": 0.0,
    "noise": "gaussian",
    "slot_weights": "dpace",
    "dpace_alpha": 0.5,
    "anchor_budget": None,
    "loss_norm": "weights",
    "save_every": 1000,
    "keep_last": 2,
    "eval_every": 0,
    "eval_samples": 2000,
    "eval_replay_prompts": 256,
    "log_every": 10,
    "workers": 2,
    "cache_dir": None,
    "cache_size": None,
    "on_corrupt": "stop",
    "threads": None,
    "num_layers": None,
    "num_heads": None,
    "num_kv_heads": None,
    "head_dim": None,
    "intermediate_size": None,
    "layer_types": None,
    "sliding_window": None,
    "rope_theta": None,
    "mask_token_id": None,
    "drafter_config": None,
    "init_from": None,
    "resume": None,
    "grad_comm": "bf16",
    "grad_checkpoint": False,
    "mixed_precision": "auto",
    "audit": False,
}
LATER = {
    "acceptance_weight": 0.0,
    "head": None,
    "markov_rank": None,
    "markov_optimizer": "muon",
    "soft_targets": "none",
    "soft_weight": 0.5,
}  # settings added since, each at a default that trains as before it existed
UNSET = {"follow_poll": None}  # defaults now unset: --follow-poll's 30 s is filled in only with --follow
RECORD = FLAT_DEFAULTS | LATER | UNSET
OLD_CHECKPOINT = Path(__file__).parents[1] / "data" / "schema1" / "checkpoint_config.json"  # a drafter of an early run


def test_the_record_is_the_flat_one():
    assert TrainConfig().record() == RECORD
    assert json.loads(json.dumps(TrainConfig().record())) == RECORD  # as written to JSON


def test_a_config_round_trips_through_its_record():
    """One setting away from its default in every component: the record holds it under its own name,
    and the config made from the record (JSON and back, as a resume reads it) is the same."""
    given = {"eval_shards": "3", "follow_poll": 2.0, "muon_lr": 0.01, "anchors": 64, "num_layers": 2, "keep_last": 5}
    followed = {"follow": True, "shards": "0-2", "max_steps": 10}  # what --follow-poll goes with
    config = TrainConfig.of(**given, **followed)
    record = json.loads(json.dumps(config.record()))
    assert record == RECORD | given | followed
    assert TrainConfig.of(**record) == config
    assert (
        config.data.eval_shards,
        config.shard_schedule.follow_poll,
        config.optim.muon_lr,
        config.loss.anchors,
        config.drafter.num_layers,
        config.run.keep_last,
    ) == tuple(given.values())


def test_an_old_record_still_loads_and_resumes():
    """A record written by an early run (37 of today's settings): it makes a TrainConfig, and a run with
    what training did before the later settings existed (run_dir.BEFORE_THE_FIELD) may resume it."""
    from stages.train.run_dir import BEFORE_THE_FIELD, resumable

    old = json.loads(OLD_CHECKPOINT.read_text())["dflash_pipeline"]["train_config"]
    assert len(old) == 37 and set(old) < set(FLAT_DEFAULTS)
    config = TrainConfig.of(**old)
    assert config.record() == RECORD | old
    then = {k: v for k, v in BEFORE_THE_FIELD.items() if k not in old}
    resumable(TrainConfig.of(**old, **then), old)
    with pytest.raises(ConfigError, match="--optimizer was 'adamw', now 'muon'"):
        resumable(config, old)  # today's default optimizer is not what that run trained with
    with pytest.raises(ConfigError, match="--anchors was 8, now 16"):
        resumable(TrainConfig.of(**{**old, **then, "anchors": 16}), old)


def test_an_unknown_setting_is_refused():
    with pytest.raises(TypeError, match="no setting learning_rate"):
        TrainConfig.of(learning_rate=1e-3)


def test_every_setting_belongs_to_one_component_and_keeps_its_flag():
    names = [name for cls in parts(TrainConfig).values() for name in leaves(cls)]
    assert sorted(names) == sorted(RECORD)  # each once: a record key is one component's setting
    assert flag_of(TrainConfig, "muon_lr") == flag_of(OptimConfig, "muon_lr") == "--muon-lr"


def test_a_component_named_as_its_setting_keeps_the_settings_option():
    """TrainConfig.shard_schedule (the component) holds --shard-schedule (the setting): the option is
    the setting's, a path, not the component's config class."""
    from stages.settings import owner_of
    from stages.train.config import ShardScheduleConfig
    from tests.stages.test_command import parse

    assert owner_of(TrainConfig, "shard_schedule") is ShardScheduleConfig
    config = parse(TrainConfig, ["--shard-schedule", "runs/a/shards.json", "--shards", "0-3", "--max-steps", "8"])
    assert config.shard_schedule.shard_schedule == "runs/a/shards.json"


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: OptimConfig(optimizer="adamw", muon_lr=0.01), "--muon-lr 0.01: is only used by --optimizer muon"),
        (lambda: LossConfig(gamma=7.0), "--gamma 7.0: is only used by --slot-weights exp"),
        (lambda: LossConfig(acceptance_weight=1.5), "--acceptance-weight 1.5: expected 0 <= weight <= 1"),
        (lambda: LossConfig(acceptance_weight=-0.1), "--acceptance-weight -0.1: expected 0 <= weight <= 1"),
        (lambda: DataConfig(shuffle_window=4), "--shuffle-window 4: is only used by --data-order node"),
        (lambda: TrainConfig.of(follow=True, shards="0-3"), "--follow True: needs --max-steps"),
        (lambda: TrainConfig.of(shard_schedule="s.json", max_steps=3), "--shard-schedule s.json: needs --shards"),
        (lambda: TrainConfig.of(block_size=12, slot_weights="exp"), "--block-size 12: no default loss decay"),
    ],
)
def test_each_check_is_made_where_its_settings_are(make, message):
    """A component checks its own settings as it is made; TrainConfig those of two components."""
    with pytest.raises(ConfigError) as e:
        make()
    assert str(e.value).startswith(message)


def test_a_component_alone_skips_the_cross_checks():
    """--block-size 12 with exp weights has no default gamma, but --init-from's checkpoint decides the
    block size: only the TrainConfig that holds both can tell."""
    LossConfig(block_size=12, slot_weights="exp")
    TrainConfig.of(block_size=12, slot_weights="exp", init_from="ckpt")
