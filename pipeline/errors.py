"""User-facing errors: one clear line, no traceback, at the command line."""


class PipelineError(Exception):
    """A mistake in the user's input or environment. The message names what and where."""
