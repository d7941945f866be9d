"""Files as readable as any other file the user makes: mode 0666 less their umask.

Some writers create owner-only files (0600) whatever the umask: safetensors' `save_file` (0.8, a
temporary file then a rename) and so Accelerate's `save_state`. A checkpoint written that way cannot
be read by a serving engine or a teammate under another account. `as_umask` gives such a file the
mode a plain `open(path, "w")` would have given it.
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path

_SWAP = threading.Lock()


def umask() -> int:
    """This process's umask: read from /proc/self/status (Linux 4.7+), which changes nothing; where
    that is missing, set and set back once (the only way POSIX gives) and remembered."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return _swapped_umask()


@functools.cache
def _swapped_umask() -> int:
    with _SWAP:
        mask = os.umask(0o077)  # a file another thread makes meanwhile is at most owner-only, never wider
        os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a new regular file gets from `open(path, "w")`: 0o666 less the umask."""
    return 0o666 & ~umask()


def as_umask(*paths: str | Path) -> None:
    """Give each file (ours, just written) the mode file_mode() says."""
    for path in paths:
        os.chmod(path, file_mode())


def tree_as_umask(directory: str | Path) -> None:
    """Every file under DIRECTORY that this user owns (just written) as_umask. Files of another owner
    (another node's process writing a shared directory under its own uid) are left as they are."""
    me = os.geteuid()
    as_umask(*(p for p in Path(directory).rglob("*") if p.is_file() and not p.is_symlink() and p.stat().st_uid == me))
