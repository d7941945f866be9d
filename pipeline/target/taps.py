"""Which target layers feed the drafter (SPEC §2, tap layers), and how their outputs are taken.

Tap k is the OUTPUT of decoder layer k (0-based), i.e. Hugging Face `hidden_states[k+1]`. It is
taken by a forward hook on the layer itself (`tapping`), so no index arithmetic on
`hidden_states` can be off by one.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import TYPE_CHECKING

from store.errors import ConfigError

if TYPE_CHECKING:
    import torch

DEFAULT_NUM_TAPS = 5


class StopForward(Exception):
    """Raised by the last tap's hook when nothing after it is needed."""


@contextmanager
def tapping(layers: torch.nn.ModuleList, taps: list[int], take: Callable, stop_after_last: bool = False):
    """While active, each forward hands the output of layer k to take(k, output) ([b, T, H]) for every
    tap k, as the layer returns it (a dict's __setitem__ keeps them all; Target.capture copies each
    to the host at once); with stop_after_last it raises StopForward after the last tap (catch it)."""

    def hook_for(k: int):
        def hook(_module, _inputs, output):
            take(k, output[0] if isinstance(output, tuple) else output)
            if stop_after_last and k == taps[-1]:
                raise StopForward

        return hook

    handles = [layers[k].register_forward_hook(hook_for(k)) for k in taps]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def default_taps(num_layers: int, num_taps: int = DEFAULT_NUM_TAPS) -> list[int]:
    """DFlash's layer choice: round(1 + i*(L-4)/(n-1)); one tap is the middle layer.

    Tap k means the OUTPUT of decoder layer k (0-based), i.e. Hugging Face hidden_states[k+1].
    """
    if num_taps == 1:
        return [num_layers // 2]
    return [int(round(1 + i * (num_layers - 4) / (num_taps - 1))) for i in range(num_taps)]


def parse_taps(text: str | None, num_layers: int) -> list[int]:
    """Taps from '--taps' text ('1,16,31' or 'n=5'); default: the formula with 5 taps."""
    if text is None or text == "":
        taps = default_taps(num_layers)
    elif text.startswith("n="):
        try:
            n = int(text[2:])
        except ValueError:
            raise ConfigError("--taps", repr(text), "expected 'n=<count>' or comma-separated layer ids") from None
        if n < 1:
            raise ConfigError("--taps", repr(text), "need at least one tap")
        taps = default_taps(num_layers, n)
    else:
        try:
            taps = [int(t) for t in text.split(",")]
        except ValueError:
            raise ConfigError("--taps", repr(text), "expected comma-separated layer ids such as '1,16,31'") from None
    return validate_taps(taps, num_layers)


def validate_taps(taps: list[int], num_layers: int) -> list[int]:
    if not taps:
        raise ConfigError("--taps", None, "need at least one tap layer")
    bad = [t for t in taps if not 0 <= t < num_layers]
    if bad:
        raise ConfigError(
            "--taps",
            None,
            f"layer id(s) {bad} out of range: the target has {num_layers} decoder layers (ids 0-{num_layers - 1})",
        )
    if sorted(set(taps)) != list(taps):
        raise ConfigError("--taps", taps, "ids must be strictly increasing and distinct")
    return list(taps)
