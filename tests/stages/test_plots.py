"""The learning curve: training as lines, held-out points as markers, joined only when there are
enough of them to show a trend."""

import json

from stages import plots
from stages.plots import MIN_TREND, curve_series, learning_curve


def records(evals: int, replayed: int) -> list[dict]:
    """metrics.jsonl records: 10 training windows, `evals` held-out points, the last `replayed` with replay tau."""
    train = [{"split": "train", "step": s, "loss": 5 - s / 10, "tau_streak": 1 + s / 10} for s in range(10, 110, 10)]
    steps = [round(100 * i / max(1, evals - 1)) for i in range(evals)]
    held = [
        {
            "split": "eval",
            "step": s,
            "loss": 5 - s / 50,
            "tau_streak": 1 + s / 50,
            **({"tau_replay": 1 + s / 60, "replay_prompts": 8} if i >= evals - replayed else {}),
        }
        for i, s in enumerate(steps)
    ]
    return train + held


def by_label(series) -> dict:
    return {(s.panel, s.label.split(" (")[0]): s for s in series}


def test_two_held_out_points_are_markers_without_a_line():
    got = by_label(curve_series(records(evals=2, replayed=1)))
    for key in (("loss", "held out"), ("tau", "held out, streak"), ("tau", "held out, replayed")):
        assert got[key].marker and not got[key].line, key
    assert got[("loss", "held out")].steps == [0, 100]
    train = got[("loss", "train")]
    assert train.line and train.marker is None and len(train.steps) == 10  # the training curve stays a line


def test_enough_held_out_points_are_joined():
    got = by_label(curve_series(records(evals=MIN_TREND, replayed=MIN_TREND - 1)))
    assert got[("loss", "held out")].line and got[("tau", "held out, streak")].line
    assert got[("loss", "held out")].marker == "o"
    assert not got[("tau", "held out, replayed")].line  # its own count decides: one short


def test_the_png_draws_the_series_as_chosen(tmp_path, monkeypatch):
    """learning_curve's lines, read from the figure before it is closed: no line through two held-out points."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records(evals=2, replayed=2)))
    figures = []
    monkeypatch.setattr(plots.plt, "close", figures.append)
    png = learning_curve(metrics, tmp_path / "curve.png")
    assert png.stat().st_size > 0
    lines = {(ax.get_title(), ln.get_label()): ln for ax in figures[0].axes for ln in ax.get_lines()}
    held = [ln for (_, label), ln in lines.items() if label.startswith("held out")]
    assert len(held) == 3 and all(ln.get_linestyle() == "None" and ln.get_marker() in ("o", "s") for ln in held)
    assert lines[("loss", "train (window mean)")].get_linestyle() == "-"
