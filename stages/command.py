"""A stage as a command line: click options generated from its config dataclass, and errors as one
line. Entry points are then a few lines: `@options(Config)`, run the stage, print its summary."""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
import typing

import click

from stages.paths import describe, refusal
from stages.settings import build, flag_of, leaves, owner_of
from store.errors import ConfigError, UserError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def log(message: str) -> None:
    """Progress and warnings go to stderr; results go to stdout."""
    click.echo(message, err=True)


def options(config_cls):
    """Decorator: one click option per setting of config_cls, its components' included (flag, type,
    default and help from the field); the command is called with config=config_cls made from their
    values (stages/settings.build) plus its own other options."""
    fields = leaves(config_cls)
    hints = {name: typing.get_type_hints(owner_of(config_cls, name))[name] for name in fields}

    def decorate(fn):
        @functools.wraps(fn)
        def command(**kw):
            return fn(config=build(config_cls, {name: kw.pop(name) for name in fields}), **kw)

        for name, f in reversed(fields.items()):
            flag = flag_of(config_cls, name)
            if _base(hints[name]) is bool and f.default is True:  # on by default: --x/--no-x
                flag = f"{flag}/--no-{flag[2:]}"
            command = click.option(flag, name, **_option(f, hints[name]))(command)
        return command

    return decorate


def _option(f: dataclasses.Field, hint) -> dict:
    meta = f.metadata
    kind = _base(hint)
    required = f.default is dataclasses.MISSING
    default = None if required else f.default
    kw = {"help": meta.get("help", ""), "default": default, "required": required}
    if meta.get("parse"):
        kw.update(type=str, default=None, callback=_parser(meta["parse"], default))
    elif kind is bool:
        kw.update(is_flag=True)
    elif typing.get_origin(kind) is tuple:
        kw.update(type=typing.get_args(kind)[0], multiple=True, default=default or ())
    elif meta.get("choices"):
        kw.update(type=click.Choice(meta["choices"]))
    else:
        kw.update(type=kind)
    if meta.get("default_text"):  # click would put it in parentheses
        kw.update(help=f"{kw['help']} [default: {meta['default_text']}]", show_default=False)
    else:
        kw["show_default"] = kind is not bool and default not in (None, ())
    return {**kw, **meta.get("click", {})}


def _base(hint):
    """X from `X | None`."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else hint
    return hint


def _parser(parse, default):
    """A flag's text through its parse function; text it refuses is one line (ConfigError: the flag,
    the text as given, what was expected)."""

    def callback(_ctx, param, value):
        if value is None:
            return default
        try:
            return parse(value)
        except ValueError as e:
            raise ConfigError(param.opts[0], value, str(e)) from None

    return callback


class Interrupted(KeyboardInterrupt):
    """An interrupt a stage caught and re-raised with its own line (what to do depends on how far the
    run got); a plain interrupt ends with the entry point's line."""


def run_command(command, interrupted: str = "interrupted") -> None:
    """Run a click command; a UserError, the file system's refusal of a path the user gave (stages/
    paths.py: permission, a file in the way, read-only, full, too large) or an interrupt becomes one
    `error:` line (exit 2 / 130; an Interrupted says its own). Anything else keeps its traceback."""
    try:
        command.main(standalone_mode=False)
    except UserError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt) as e:
        said = next((str(x) for x in (e, e.__cause__) if isinstance(x, Interrupted)), interrupted)
        click.echo(f"error: {said}", err=True)
        sys.exit(130)
    except Exception as e:
        refused = refusal(e)
        if refused is None:
            raise
        click.echo(f"error: {describe(refused)}", err=True)
        sys.exit(2)
