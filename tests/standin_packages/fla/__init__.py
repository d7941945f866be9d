"""A stand-in for flash-linear-attention (tests/fla_standin.py puts it first on the path): the
two gated delta rule entry points transformers dispatches to, computed by the naive recurrence in
PyTorch, counting their calls. Not the real package: it lets a test on any CPU make transformers'
fla dispatch happen and check what the store records."""

__version__ = "0.0.0+standin"
