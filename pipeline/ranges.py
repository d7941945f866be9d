"""Shard range text: "0-63", "0-3,8,10-12"."""

from __future__ import annotations

import re

from pipeline.errors import PipelineError

_PART = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_ranges(text: str, limit: int | None = None) -> list[int]:
    """Sorted, de-duplicated ids from range text; each id < limit when a limit is given."""
    ids: set[int] = set()
    for part in str(text).replace(" ", "").split(","):
        m = _PART.match(part)
        if not m:
            raise PipelineError(f"invalid shard range {text!r}: expected e.g. '0-63' or '0-3,8,10-12', got part {part!r}")
        lo, hi = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
        if hi < lo:
            raise PipelineError(f"invalid shard range {text!r}: {lo}-{hi} runs backwards")
        ids.update(range(lo, hi + 1))
    if limit is not None and ids and max(ids) >= limit:
        raise PipelineError(f"shard range {text!r} reaches shard {max(ids)}, but the store has {limit} shards (0-{limit - 1})")
    return sorted(ids)


def format_ranges(ids: list[int]) -> str:
    """Compact text for ids: [0,1,2,5] -> '0-2,5'."""
    out: list[str] = []
    ids = sorted(set(ids))
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)
