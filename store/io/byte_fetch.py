"""Byte ranges of a store's files, fetched as a batch: on an object store all in flight at once,
one GET each with its Range header (no HEAD first, no read-ahead); on a local disk read one after
another into a reused buffer.

A range is (file, start, end): bytes start .. end of the file, end None for up to its end, and a
negative start with end None for its last -start bytes (a suffix range: a shard file's index is
at its end). s3fs sends exactly one ranged GET for each of these (fs.cat_ranges); a whole-file
read asked for without a range would first ask the file's size (a HEAD) to split a large object.
"""

from __future__ import annotations

import threading

import numpy as np

Range = tuple[str, int, "int | None"]
_arena = threading.local()


def fetch(fs, local: bool, ranges: list[Range]) -> list:
    """The bytes of each range, in order (bytes, or a uint8 view of this thread's reused buffer for
    a local range with both ends, valid until the next local fetch in this thread); in place of a
    range that cannot be read, its exception (FileNotFoundError: no such file)."""
    if not ranges:
        return []
    if not local:
        return fs.cat_ranges([r[0] for r in ranges], [r[1] for r in ranges], [r[2] for r in ranges], on_error="return")
    sized = sum(r[2] - r[1] for r in ranges if r[1] >= 0 and r[2] is not None)
    held = getattr(_arena, "buf", None)
    if held is None or len(held) < sized:
        held = _arena.buf = np.empty(sized, np.uint8)  # a 27B-width chunk is 13 MB: fresh buffers cost page faults
    out, at = [], 0
    for path, start, end in ranges:
        try:
            if start >= 0 and end is not None:
                out.append(_read_into(path, start, held[at : at + end - start]))
                at += end - start
            else:
                out.append(fs.cat_file(path, start=start, end=end))
        except OSError as e:
            out.append(e)
    return out


def _read_into(path: str, start: int, into: np.ndarray) -> np.ndarray:
    """Bytes start .. start + len(into) of a local file, read into `into`; fewer when the file ends first."""
    with open(path, "rb") as f:
        f.seek(start)
        got = f.readinto(memoryview(into))
    return into[:got]
