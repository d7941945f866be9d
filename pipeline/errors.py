"""User-facing errors: one clear line, no traceback, at the command line."""

from __future__ import annotations

import sys


class PipelineError(Exception):
    """A mistake in the user's input or environment. The message names what and where."""


def run_command(command, interrupted: str = "interrupted") -> None:
    """Run a click command; a PipelineError or an interrupt becomes one `error:` line (exit 2 / 130)."""
    import click

    try:
        command.main(standalone_mode=False)
    except PipelineError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo(f"error: {interrupted}", err=True)
        sys.exit(130)
