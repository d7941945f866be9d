"""File modes in tests: a umask for a block, the modes of a tree, a read by another account."""

import contextlib
import os
import pickle
import stat
from pathlib import Path

NOBODY = 65534  # the uid a root test process reads as (setuid in a forked child)


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def file_modes(directory: Path) -> dict[str, str]:
    """{relative path: '0644'} of every file under DIRECTORY."""
    return {
        p.relative_to(directory).as_posix(): f"{stat.S_IMODE(p.stat().st_mode):04o}"
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def as_another_user(fn):
    """fn() run by an account that does not own the files: as root, in a forked child that became
    NOBODY (root reads everything); else in this process (the caller made the file unreadable).
    Returns fn's result or the exception it raised (both pickled back from a child)."""
    if os.geteuid() != 0:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 (returned to the test to inspect)
            return e
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(r)
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                out = fn()
            except Exception as e:  # noqa: BLE001
                out = e
            os.write(w, pickle.dumps(out))
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        data = fh.read()
    os.waitpid(pid, 0)
    return pickle.loads(data)
