"""Every command's flags and defaults, listed in tests/data/cli_flags.txt: a flag added, removed or
given another default is then a visible change of that file in the commit that makes it, to be
said and reviewed, not a line lost in a config dataclass.

When the change is meant, rewrite the list and say why in the commit:

    DFLASH_WRITE_FLAGS=1 pytest tests/test_flags.py
"""

import os
from pathlib import Path

import click
import pytest

FLAGS = Path(__file__).parent / "data" / "cli_flags.txt"


def commands() -> dict[str, click.Command]:
    import evaluate
    import train
    from pipeline.cli import cli

    return {
        **{f"pipeline {name}": cmd for name, cmd in sorted(cli.commands.items())},
        "train.py": train.main,
        "evaluate.py": evaluate.main,
    }


def default(p: click.Parameter):
    """The default as a plain value: a flag left unset by click's own sentinel (click >= 8.2) is off."""
    plain = p.default is None or isinstance(p.default, (str, int, float, bool, tuple))
    return p.default if plain else False if getattr(p, "is_flag", False) else repr(type(p.default).__name__)


def listing() -> str:
    """One line a parameter: command, its flags (or argument name), the default as the command sees it."""
    lines = []
    for name, cmd in commands().items():
        for p in cmd.params:
            if isinstance(p, click.Argument):
                lines.append(f"{name} <{p.name}>")
            elif "--help" not in p.opts:
                lines.append(f"{name} {'/'.join(p.opts + p.secondary_opts)} = {default(p)!r}")
    return "\n".join(lines) + "\n"


def test_every_flag_and_default_is_listed():
    got = listing()
    if os.environ.get("DFLASH_WRITE_FLAGS"):
        FLAGS.write_text(got)
        pytest.skip(f"wrote {FLAGS}: commit it saying why the flags changed")
    want = FLAGS.read_text()
    added = sorted(set(got.splitlines()) - set(want.splitlines()))
    gone = sorted(set(want.splitlines()) - set(got.splitlines()))
    assert not added and not gone, (
        f"the flags changed (new or changed: {added}; gone or changed: {gone}); if "
        "meant, rerun with DFLASH_WRITE_FLAGS=1 and say why in the commit"
    )
    assert got.count("train.py --") > 50 and "pipeline extract --shards" in got
