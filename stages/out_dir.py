"""A run's output directory: what a failed run created and left empty is removed again.

A run that fails (a user mistake found after OUT was made, a crash, Ctrl-C) must not leave an empty
`--out` behind, which the next run, or the user, would take for a run. Only what this run created
goes: OUT and the parents it made, deepest first, each only while it is empty. A directory that
existed before the run is left as it was, empty or not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path


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
