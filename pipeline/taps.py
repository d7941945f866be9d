"""Which target layers feed the drafter (SPEC §2, tap layers)."""

from __future__ import annotations

from pipeline.errors import PipelineError

DEFAULT_NUM_TAPS = 5


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
            raise PipelineError(f"--taps {text!r}: expected 'n=<count>' or comma-separated layer ids") from None
        if n < 1:
            raise PipelineError(f"--taps {text!r}: need at least one tap")
        taps = default_taps(num_layers, n)
    else:
        try:
            taps = [int(t) for t in text.split(",")]
        except ValueError:
            raise PipelineError(f"--taps {text!r}: expected comma-separated layer ids such as '1,16,31'") from None
    return validate_taps(taps, num_layers)


def validate_taps(taps: list[int], num_layers: int) -> list[int]:
    if not taps:
        raise PipelineError("--taps: need at least one tap layer")
    bad = [t for t in taps if not 0 <= t < num_layers]
    if bad:
        raise PipelineError(
            f"--taps: layer id(s) {bad} out of range: the target has {num_layers} decoder layers (ids 0-{num_layers - 1})")
    if sorted(set(taps)) != list(taps):
        raise PipelineError(f"--taps {taps}: ids must be strictly increasing and distinct")
    return list(taps)
