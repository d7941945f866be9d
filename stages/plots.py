"""PNG plots of what a run measured (matplotlib, no display needed)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def learning_curve(metrics: str | Path, png: str | Path, title: str = "") -> Path:
    """Training loss and streak tau per step, with the held-out (eval) points and their replayed tau,
    from metrics.jsonl."""
    recs = [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()]
    fig, (ax_loss, ax_tau) = plt.subplots(1, 2, figsize=(10, 3.8))
    for split, style in (("train", "-"), ("eval", "o-")):
        rs = [r for r in recs if r["split"] == split]
        if not rs:
            continue
        steps = [r["step"] for r in rs]
        label = "train (window mean)" if split == "train" else "held out"
        ax_loss.plot(steps, [r["loss"] for r in rs], style, label=label, markersize=4)
        ax_tau.plot(steps, [r["tau_streak"] for r in rs], style, label=label + ", streak", markersize=4)
        replayed = [r for r in rs if "tau_replay" in r]
        if replayed:
            ax_tau.plot([r["step"] for r in replayed], [r["tau_replay"] for r in replayed], "s-", markersize=4,
                        label=f"held out, replayed ({replayed[-1]['replay_prompts']} prompts)")
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
