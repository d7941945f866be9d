"""Shard range text: "0-63", "0-3,8,10-12", "all"."""

from __future__ import annotations

import re

from store.errors import ConfigError

_PART = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_ranges(text: str, limit: int | None = None, flag: str = "--shards") -> list[int]:
    """Sorted, de-duplicated ids from range text; each id < limit when a limit is given ("all":
    every id below it). Errors name `flag`, the option the text came from."""
    if str(text).strip() == "all":
        if limit is None:
            raise ConfigError(flag, repr(text), "'all' needs a known shard count")
        return list(range(limit))
    ids: set[int] = set()
    for part in str(text).replace(" ", "").split(","):
        m = _PART.match(part)
        if not m:
            raise ConfigError(
                flag,
                repr(text),
                f"invalid shard range: expected e.g. '0-63', '0-3,8,10-12' or 'all', got part {part!r}",
            )
        lo, hi = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
        if hi < lo:
            raise ConfigError(flag, repr(text), f"invalid shard range: {lo}-{hi} runs backwards")
        ids.update(range(lo, hi + 1))
    if limit is not None and ids and max(ids) >= limit:
        raise ConfigError(
            flag, repr(text), f"reaches shard {max(ids)}, but the store has {limit} shards (0-{limit - 1})"
        )
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
