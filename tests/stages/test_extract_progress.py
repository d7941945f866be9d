"""Extraction's progress inside a shard: the bar on a terminal, a line in a log."""

import io
import sys

from stages.extract import progress
from stages.extract.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_shows_the_batch_being_generated_and_the_rows_and_tokens_done(monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    lines = []
    with Progress(10, "", lines.append) as p:
        p.generating(4, 1, 256, 10)
        shown = sys.stderr.getvalue()
        p.done(10, 1234, 4)
    assert "0/10" in shown and "shard 4: generating token 1/256 for 10 rows" in shown  # before the batch ends
    assert "10/10" in sys.stderr.getvalue() and "1234 tokens" in sys.stderr.getvalue()
    assert lines == []  # a bar, so no lines


def test_without_a_terminal_a_line_comes_every_period_and_not_before(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    lines = []
    with Progress(12, "", lines.append) as p:
        p.drop(2)  # a shard another process writes
        p.generating(4, 1, 256, 10)
        p.done(4, 500, 4)
        assert lines == []  # a fast run says nothing more than its shard lines
        monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)
        p.generating(4, 7, 256, 6)
        p.done(6, 900, 4)
    assert sys.stderr.getvalue() == ""
    assert lines[0].startswith("progress: 4/10 rows, 500 tokens, ") and lines[0].endswith(
        "tokens/s; shard 4: generating token 7/256 for 6 rows"
    )
    assert lines[1].startswith("progress: 10/10 rows, 900 tokens, ") and lines[1].endswith("tokens/s; shard 4")
