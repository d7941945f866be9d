"""A run's output directory: one writer at a time, and what a failed run created and left empty is
removed again.

Each command that writes a directory holds a lease on it while it does (`claim`: a lock file of
store/io/locks.py, refreshed every 30 s; a killed writer's is taken over, its pid gone or no heartbeat
for 10 minutes): train.py `OUT/.train.lock`, evaluate.py `OUT/.evaluate.lock`, `pipeline export`
a sibling `.NAME.export.lock` (it replaces OUT_DIR whole). A second writer is refused naming the first.

A run that fails (a user mistake found after OUT was made, a crash, Ctrl-C) must not leave an empty
`--out` behind, which the next run, or the user, would take for a run. Only what this run created
goes: OUT and the parents it made, deepest first, each only while it is empty. A directory that
existed before the run is left as it was, empty or not.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

from store.errors import ConfigError
from store.io.locks import LockFile


def claim(lock: Path, flag: str, value, writer: str) -> LockFile:
    """The lease LOCK, taken for this process; a ConfigError naming flag, the holder and what to do
    while another live process holds it (`writer`: what that process is, 'training run')."""
    held = LockFile(lock)
    holder = held.try_acquire()
    if holder is not None:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"])) if "since" in holder else "?"
        raise ConfigError(
            flag,
            value,
            f"another {writer} is writing it (host {holder.get('host')}, pid "
            f"{holder.get('pid')}, since {since}); wait for it, or choose another {flag}",
        )
    return held


def missing(out: Path) -> list[Path]:
    """OUT and those of its parents that do not exist yet, deepest first."""
    created = []
    for p in (Path(out).absolute(), *Path(out).absolute().parents):
        if p.exists():
            break
        created.append(p)
    return created


@contextlib.contextmanager
def removed_if_failed_empty(out: str | Path, scratch: tuple[str, ...] = (), owner: bool = True) -> Iterator[None]:
    """Run the block; if it raises, remove the directories of OUT's path that did not exist before it
    and that it left empty. SCRATCH: names of files the run keeps in OUT for itself (a launch mark),
    removed with OUT when nothing else is there. owner False (another process of a launch): nothing."""
    created = missing(Path(out)) if owner else []
    try:
        yield
    except BaseException:
        remove_empty(created, scratch)
        raise


def remove_empty(created: list[Path], scratch: tuple[str, ...] = ()) -> None:
    """Remove each directory (deepest first) while it is empty; stop at the first that is not."""
    for d in created:
        try:
            names = {p.name for p in d.iterdir()}
        except FileNotFoundError:
            continue
        except OSError:
            return
        if names and names <= set(scratch):
            for name in names:
                (d / name).unlink(missing_ok=True)
        try:
            d.rmdir()
        except OSError:  # not empty (or not ours to remove): neither it nor its parents go
            return
