"""bench/harness.py's shared flags (--json, --force, --toy, --threads) mean the same before a
subcommand's name as after it: `--toy capture` once kept the subcommand's own default (not toy) and
built the full-size target."""

import argparse

import pytest

from bench import harness


def parse(argv: list[str], main=None):
    p = main or harness.parser(None)
    harness.subcommand(p.add_subparsers(dest="cmd", required=True), "capture", "a subcommand")
    return harness.parse(p, argv)


@pytest.mark.parametrize("before", [True, False], ids=["before the name", "after it"])
def test_a_shared_flag_is_kept_wherever_it_is_given(before, tmp_path):
    flags = ["--toy", "--threads", "3", "--force", "--json", str(tmp_path / "r.json")]
    args = parse([*flags, "capture"] if before else ["capture", *flags])
    assert (args.toy, args.threads, args.force, args.json) == (True, 3, True, str(tmp_path / "r.json"))


def test_the_defaults_hold_when_nothing_is_given():
    args = parse(["capture"])
    assert (args.toy, args.threads, args.force, args.json) == (False, 1, False, None)


def test_a_main_parser_without_the_shared_flags_gets_their_defaults():
    args = parse(["capture"], main=argparse.ArgumentParser())  # as bench/store_bench.py builds its own
    assert (args.toy, args.threads, args.force, args.json) == (False, 1, False, None)
