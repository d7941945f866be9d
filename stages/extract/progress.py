"""Extraction's progress: rows and tokens done and the rate, reported inside a shard. On a terminal
a bar (tqdm, to stderr); elsewhere (a log file, a pipe, a batch job) a line at most every
LINE_EVERY_S seconds through the run's log. Both also move while the target generates a batch, one
token at a time, so a shard whose one batch takes minutes is not silent."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

LINE_EVERY_S = 30.0  # the line's period without a terminal
REFRESH_S = 0.5  # the bar redrawn at most this often while the target generates


class Progress:
    """Rows done of `total`, tokens stored, and the batch the target is generating now."""

    def __init__(self, total: int, label: str, say) -> None:
        self.total, self.say = total, say
        self.rows = self.tokens = 0
        self.shard: int | None = None
        self.step = ""  # what the batch in progress is at, while the target generates it
        self.t0 = time.perf_counter()
        self.shown = float("-inf")  # when the bar was last redrawn, or the last line said
        self.bar = tqdm(
            total=total, unit="row", desc=f"{label}extract", disable=None, dynamic_ncols=True, file=sys.stderr
        )

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()

    def drop(self, rows: int) -> None:
        """A shard another process writes: its rows leave the total."""
        self.total -= rows
        self.bar.total = self.total

    def done(self, rows: int, tokens: int, shard: int) -> None:
        """A batch of `rows` rows of `shard` written; `tokens` stored so far by this run."""
        self.rows += rows
        self.tokens, self.shard, self.step = tokens, shard, ""
        self.bar.set_postfix_str(self.status(), refresh=False)
        self.bar.update(rows)
        self.line()

    def generating(self, shard: int, token: int, limit: int, rows: int) -> None:
        """The target made the token-th completion token of a batch of `rows` rows (at most `limit`)."""
        self.shard, self.step = shard, f"generating token {token}/{limit} for {rows} rows"
        now = time.perf_counter()
        if not self.bar.disable and now - self.shown >= REFRESH_S:
            self.shown = now
            self.bar.set_postfix_str(self.status())
        self.line()

    def status(self) -> str:
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        text = f"{self.tokens} tokens, {rate:.0f} tokens/s"
        if self.shard is not None:
            text += f"; shard {self.shard}" + (f": {self.step}" if self.step else "")
        return text

    def line(self) -> None:
        """Without a bar: a line, when LINE_EVERY_S have passed since the last (or the start)."""
        now = time.perf_counter()
        if self.bar.disable and now - max(self.shown, self.t0) >= LINE_EVERY_S:
            self.shown = now
            self.say(f"progress: {self.rows}/{self.total} rows, {self.status()}")
