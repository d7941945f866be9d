"""One source for every default and help text: the config dataclasses. The command-line options are
generated from them (stages/command.py) and validation happens in the configs themselves."""

import dataclasses

import click
import pytest
from click.testing import CliRunner

from stages.command import options
from stages.evaluate.config import EvalConfig
from stages.extract.config import ExtractConfig
from stages.plan.config import PlanConfig
from stages.settings import build, flag_of, leaves, parts
from stages.train.config import TrainConfig
from store.errors import ConfigError

REQUIRED = {EvalConfig: {"checkpoints": ("ck",)}}
CONFIGS = [ExtractConfig, TrainConfig, EvalConfig, PlanConfig]


def command_for(config_cls):
    @click.command()
    @options(config_cls)
    def cmd(config):
        return config

    return cmd


def parse(config_cls, args: list[str]):
    return command_for(config_cls).main(args, standalone_mode=False)


def cli_args(values: dict, config_cls) -> list[str]:
    out = []
    for name, value in values.items():
        for v in value if isinstance(value, tuple) else (value,):
            out += [flag_of(config_cls, name), str(v)]
    return out


@pytest.mark.parametrize("config_cls", CONFIGS)
def test_the_command_line_defaults_are_the_configs(config_cls):
    required = REQUIRED.get(config_cls, {})
    assert parse(config_cls, cli_args(required, config_cls)) == build(config_cls, required)


@pytest.mark.parametrize("config_cls", CONFIGS)
def test_every_field_has_a_flag_and_help(config_cls):
    text = CliRunner().invoke(command_for(config_cls), ["--help"], terminal_width=200).output
    for name, f in leaves(config_cls).items():  # TrainConfig's: its components'
        assert f.metadata["help"], name
        assert flag_of(config_cls, name) in text, name


@pytest.mark.parametrize("config_cls", CONFIGS)
def test_configs_are_frozen_and_keyword_only(config_cls):
    config = build(config_cls, REQUIRED.get(config_cls, {}))
    for part in [config, *(getattr(config, name) for name in parts(config_cls))]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            part.store = "elsewhere"
        with pytest.raises(TypeError):
            type(part)("hs.zarr")


@pytest.mark.parametrize(
    "config_cls,over,message",
    [
        (ExtractConfig, {"chunk_tokens": 0}, "--chunk-tokens 0: must be at least 1"),
        (
            ExtractConfig,
            {"shard_tokens": 100, "chunk_tokens": 32},
            "--shard-tokens 100: must be a multiple of --chunk-tokens 32",
        ),
        (ExtractConfig, {"compression_level": 23}, "--compression-level 23: levels run -7 to 22"),
        (ExtractConfig, {"turns": "all"}, "--turns all: all goes with --responses dataset"),
        (TrainConfig, {"warmup_ratio": 1.5}, "--warmup-ratio 1.5: expected 0 <= ratio < 1"),
        (TrainConfig, {"lr": 0.0}, "--lr 0.0: must be positive"),
        (TrainConfig, {"block_size": 12, "slot_weights": "exp"}, "--block-size 12: no default loss decay"),
        (EvalConfig, {"checkpoints": ("ck",), "ddtree": (8, 0)}, "--ddtree (8, 0): budgets must be at least 1"),
        (EvalConfig, {"checkpoints": ("ck",), "max_prompts": 0}, "--max-prompts 0: must be at least 1"),
    ],
)
def test_a_bad_value_names_its_flag_from_python_and_the_command_line(config_cls, over, message):
    with pytest.raises(ConfigError) as e:
        build(config_cls, over)
    assert str(e.value).startswith(message)
    if "ddtree" not in over:  # the command line gives budgets as text
        with pytest.raises(ConfigError) as e:
            parse(config_cls, cli_args(over, config_cls))
        assert str(e.value).startswith(message)


def test_choices_are_checked_in_the_config_too():
    with pytest.raises(ConfigError, match="--responses nope: expected one of regenerate, server, dataset"):
        ExtractConfig(responses="nope")
    with pytest.raises(click.BadParameter):
        parse(ExtractConfig, ["--responses", "nope"])


def test_budget_text_parses():
    assert parse(EvalConfig, ["--checkpoint", "a", "--ddtree", "4,8"]).ddtree == (4, 8)
    assert parse(EvalConfig, ["--checkpoint", "a", "--ddtree", "none"]).ddtree == ()
    with pytest.raises(ConfigError, match="--ddtree 4,x: expected budgets"):
        parse(EvalConfig, ["--checkpoint", "a", "--ddtree", "4,x"])
