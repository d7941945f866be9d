"""PNG plots of what a run measured (matplotlib, no display needed)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Held-out points are joined by a line only from this many on: a line through two points reads as a
# trend that two measurements cannot show. Below it they are markers alone.
MIN_TREND = 3


@dataclass(frozen=True)
class Series:
    """One curve of the learning-curve figure: where it goes and how it is drawn."""

    panel: str  # "loss" or "tau"
    steps: list[int]
    values: list[float]
    label: str
    marker: str | None  # None: a line alone (the training window means)
    line: bool  # points joined by a line


def curve_series(recs: list[dict]) -> list[Series]:
    """The curves of metrics.jsonl's records: training loss and streak tau as lines (one point per
    window); the held-out loss, streak tau and replayed tau as markers, joined only from MIN_TREND points."""
    out = []
    for split in ("train", "eval"):
        rs = [r for r in recs if r["split"] == split]
        if not rs:
            continue
        label = "train (window mean)" if split == "train" else "held out"
        marker, line = (None, True) if split == "train" else ("o", len(rs) >= MIN_TREND)
        steps = [r["step"] for r in rs]
        out += [
            Series("loss", steps, [r["loss"] for r in rs], label, marker, line),
            Series("tau", steps, [r["tau_streak"] for r in rs], label + ", streak", marker, line),
        ]
        replayed = [r for r in rs if "tau_replay" in r]
        if replayed:
            out.append(
                Series(
                    "tau",
                    [r["step"] for r in replayed],
                    [r["tau_replay"] for r in replayed],
                    f"held out, replayed ({replayed[-1]['replay_prompts']} prompts)",
                    "s",
                    len(replayed) >= MIN_TREND,
                )
            )
    return out


def learning_curve(metrics: str | Path, png: str | Path, title: str = "") -> Path:
    """Training loss and streak tau per step, with the held-out (eval) points and their replayed tau,
    from metrics.jsonl."""
    recs = [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()]
    fig, (ax_loss, ax_tau) = plt.subplots(1, 2, figsize=(10, 3.8))
    axes = {"loss": ax_loss, "tau": ax_tau}
    for s in curve_series(recs):
        style = {"marker": s.marker, "markersize": 4} if s.marker else {}
        if s.marker and s.line:
            style.update(linestyle="-", linewidth=0.8)  # a light line under the markers
        elif s.marker:
            style.update(linestyle="none")
        axes[s.panel].plot(s.steps, s.values, label=s.label, **style)
    ax_loss.set(xlabel="step", ylabel="weighted CE loss", title="loss")
    ax_tau.set(xlabel="step", ylabel="tokens per round (bonus counted)", title="tau: streak and replayed")
    for ax in (ax_loss, ax_tau):
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)
