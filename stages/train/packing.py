"""Packed rows (--batching packed): an epoch's order of samples cut into rows of consecutive whole
samples, as many as fit in --max-length tokens (epoch_order.py orders the samples and forms the
batches of the rows; step.py keeps a packed row's samples from seeing each other)."""

from __future__ import annotations

import array

import numpy as np


def packed_rows(lengths: np.ndarray, row_tokens: int) -> np.ndarray:
    """[N] sample lengths in order -> [R + 1] where each row begins (then N): rows of consecutive
    samples, each as many as fit in row_tokens tokens (at least one). The end of a row begun at
    every sample comes from one search of the running sums; the rows are then walked from the first
    (one Python step a row, through a memoryview: no Python int a sample is made)."""
    ends = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])  # [N + 1]
    nxt = np.searchsorted(ends, ends[:-1] + row_tokens, side="right") - 1  # the row begun at s ends before nxt[s]
    nxt = memoryview(np.maximum(nxt, np.arange(1, len(lengths) + 1, dtype=np.int64)))
    starts, s = array.array("q"), 0
    while s < len(nxt):
        starts.append(s)
        s = nxt[s]
    starts.append(len(nxt))
    return np.frombuffer(starts, dtype=np.int64)
