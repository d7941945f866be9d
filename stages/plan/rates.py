"""The rates a plan multiplies by: each a figure with how it is known, `measured` (its result file
under bench/results) or `arithmetic` (the assumption it rests on)."""

from __future__ import annotations

from dataclasses import dataclass

# Store size against raw bf16 at 27B width, measured on a random-initialised 5-layer model's states
# (bench/reports/fp8_format_cpu_2026-12-03.md; the 2,048-token ratios also in bench/results/fp8_cpu.json):
# bf16 planes 0.651 over 2,048 tokens; fp8 0.349 over 2,048 tokens up to 0.410 over the first 512.
CODED = {"bf16": (0.6507, 0.6507), "fp8": (0.3485, 0.410)}
CODED_SOURCE = "measured: bench/reports/fp8_format_cpu_2026-12-03.md"
# One writer process (2 threads) and one loader worker, MB/s of raw states at 27B width (same file).
WRITER_MBPS = {"bf16": 729.0, "fp8": 591.0}
LOADER_MBPS = {"bf16": 554.0, "fp8": 506.0}
RESULT = "bench/results/fp8_cpu.json"


@dataclass(frozen=True, kw_only=True)
class Rate:
    """low-high per second (equal when one figure); how it is known and from what."""

    low: float
    high: float
    unit: str
    kind: str  # "measured" or "arithmetic"
    source: str

    def __post_init__(self) -> None:
        assert self.kind in ("measured", "arithmetic") and 0 < self.low <= self.high, self

    def text(self) -> str:
        figure = f"{self.low:,.0f}" if self.low == self.high else f"{self.low:,.0f}-{self.high:,.0f}"
        if self.high < 100:
            figure = f"{self.low:.2f}" if self.low == self.high else f"{self.low:.2f}-{self.high:.2f}"
        return f"{figure} {self.unit} ({self.kind}: {self.source})"


def gpu_hours(work: float, rate: Rate) -> tuple[float, float]:
    """(low, high) GPU-hours for `work` units at `rate` a GPU: the fast end first."""
    return work / rate.high / 3600, work / rate.low / 3600
