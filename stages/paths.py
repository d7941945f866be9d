"""The user's paths: an output directory made and checked writable before the work starts, and the
one line an OS error on a path becomes.

A path can fail for reasons of its file system, not of this tool: a file where a directory must be,
no permission, a read-only file system, a full disk or quota, a file-size limit. Each is one
`error:` line that names the path and what to do (stages/command.run_command turns the ones no
stage caught; docs/reliability.md lists them). Output directories are checked first, so a run never
works for minutes to fail on where it writes.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline.device import Process
from stages.out_contents import refuse_a_store
from store.errors import ConfigError
from store.hidden_store import HiddenStore

# errno -> (what happened, what to do). Only the file system's refusals: ENOENT, EEXIST and the like
# can be the code's own mistakes and keep their traceback.
REFUSALS = {
    errno.EACCES: ("permission denied", "choose a path you may write, or change its permissions"),
    errno.EPERM: ("operation not permitted", "choose a path you may write, or change its permissions"),
    errno.EROFS: ("read-only file system", "choose a path on a writable file system"),
    errno.ENOTDIR: ("not a directory", "choose another path, or move the file out of the way"),
    errno.EISDIR: ("is a directory", "give a file's path, not a directory's"),
    errno.ENOSPC: ("no space left on device", "free space, or choose a path on another file system"),
    errno.EDQUOT: ("disk quota exceeded", "free space within your quota, or choose another file system"),
    errno.EFBIG: (
        "file too large",
        "raise the file-size limit (`ulimit -f`), or choose a file system that takes larger files",
    ),
    errno.ENAMETOOLONG: ("file name too long", "choose a shorter path"),
}
# Where a refusal is the installation's, not the user's: this package's code, Python's library.
_CODE = [Path(__file__).resolve().parents[1] / top for top in ("store", "pipeline", "stages")]
_PYTHON = {
    Path(p).resolve() for k, p in sysconfig.get_paths().items() if k in ("stdlib", "platstdlib", "purelib", "platlib")
}


def check_inputs(store: str, out: str, flag: str = "--out") -> None:
    """What the entry points check before they import torch (a mistake answers in well under a second,
    docs/performance.md): the store opens and its root attributes read back (store/hidden_store.py),
    and the output directory can be made and written (by the main process of a launch, the one that
    writes it), without making it: a run that fails leaves no directory it made (stages/out_dir.py).
    The stages check both again as they start, for callers from Python."""
    opened = HiddenStore(store)
    opened.check_reachable()  # an object store: its bucket, credentials and endpoint, in one request
    opened.attrs  # noqa: B018 - read to check
    if Process.from_env().rank == 0:
        writable_dir(out, flag)


def writable_dir(path: str | Path, flag: str) -> None:
    """path, a directory or one that can be made, is writable: a file created and removed in it, or in
    its nearest existing parent when it does not exist yet (nothing is made), and is no store nor
    inside one; the same ConfigError as output_dir otherwise."""
    p = Path(path).absolute()
    existing = _nearest_existing(p)
    refuse_a_store(path, flag)
    with _refused_as(flag, str(path), Path(path)):
        if existing == p and not p.is_dir():
            raise FileExistsError(errno.EEXIST, "a file", str(p))
        if not existing.is_dir():  # as making p would fail
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(p))
        _probe(existing)


def output_dir(path: str | Path, flag: str, shown: str | Path | None = None) -> Path:
    """path made (with its parents) and shown writable by a file created and removed in it, before
    any work; a ConfigError naming flag, the path (or `shown`, what the user gave when path is the
    directory it goes in) and what to do otherwise, or when it is a store or lies inside one."""
    p = Path(path)
    refuse_a_store(shown if shown is not None else path, flag)
    with _refused_as(flag, str(shown if shown is not None else path), p):
        p.mkdir(parents=True, exist_ok=True)
        _probe(p)
    return p


@contextmanager
def _refused_as(flag: str, value: str, p: Path) -> Iterator[None]:
    """The file system's refusal inside, of directory p, as the ConfigError of flag's value: a file
    where p must be, or one of REFUSALS; any other OSError as it is."""
    try:
        yield
    except FileExistsError:
        what = "is a file" if value == str(p) else f"{p} is a file"
        raise ConfigError(flag, value, f"{what}, not a directory; choose another {flag}") from None
    except OSError as e:
        if e.errno not in REFUSALS:
            raise
        raise ConfigError(flag, value, f"cannot be written: {describe(e)}") from None


def _probe(directory: Path) -> None:
    probe = directory / f".write-check-{os.getpid()}"
    probe.touch()
    probe.unlink()


def describe(e: OSError) -> str:
    """'<path>: <what happened>; <what to do>' for an OSError of REFUSALS. For 'not a directory' the
    path is the file that stands where a directory must be."""
    what, fix = REFUSALS[e.errno]
    where = e.filename
    if e.errno == errno.ENOTDIR:
        blocker = _file_above(where)
        if blocker is not None:
            return f"{blocker} is a file, not a directory; {fix}"
    return f"{where}: {what}; {fix}"


FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a disk or quota full, a file-size limit reached
LOW_SPACE = 1 << 20  # bytes: a file system with less free is full for a write that failed unexplained


def full_disk(exc: BaseException, where: str | Path | None = None) -> OSError | None:
    """The OSError ENOSPC/EDQUOT/EFBIG behind exc, however wrapped (raised from, during, or in a group),
    or None. Writers that lose the errno are read too: a Rust `os error N` in the message (safetensors),
    and, for a write under `where` that failed otherwise (torch's zip writer: 'unexpected pos'), a file
    system with less than LOW_SPACE free there (then an ENOSPC naming `where`) or a file there at the
    file-size limit (then an EFBIG)."""
    chain = _chain(exc)
    for e in chain:
        if isinstance(e, OSError) and e.errno in FULL:
            return e
    for e in chain:
        code = re.search(r"os error (\d+)", str(e))
        if code and int(code[1]) in FULL:
            return OSError(int(code[1]), os.strerror(int(code[1])), None if where is None else str(where))
    if where is not None and _free(Path(where)) < LOW_SPACE:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(where))
    if where is not None and _at_size_limit(Path(where)):
        return OSError(errno.EFBIG, os.strerror(errno.EFBIG), str(where))
    return None


def _at_size_limit(where: Path) -> bool:
    """Whether a file under `where` is as large as this process may write (RLIMIT_FSIZE): a write the
    limit stopped (torch's zip writer, which torch.distributed.checkpoint writes through, says only
    'unexpected pos')."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit == resource.RLIM_INFINITY or not where.is_dir():
        return False
    return any(p.is_file() and p.stat().st_size >= limit for p in where.rglob("*"))


def _chain(exc: BaseException | None) -> list[BaseException]:
    """exc, what it was raised from or during, and a group's members, each once."""
    seen, out, stack = set(), [], [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        out.append(e)
        stack += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return out


def _free(p: Path) -> int:
    """Bytes this user may still write on the file system of p (or its nearest existing parent)."""
    return shutil.disk_usage(_nearest_existing(p.absolute())).free


def refusal(exc: BaseException) -> OSError | None:
    """The file system's refusal behind exc (itself or what it was raised from) on a path this code
    does not ship, or None: an internal error keeps its traceback."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in REFUSALS and exc.filename and not _installed(exc.filename):
            return exc
        exc = exc.__cause__
    return None


def _installed(filename) -> bool:
    """Whether filename lies in this package's code or in Python's installation."""
    p = Path(os.fsdecode(filename)).absolute()
    return any(p.is_relative_to(root) for root in (*_CODE, *_PYTHON))


def _file_above(filename) -> Path | None:
    """The nearest existing path at or above filename, when it is not a directory."""
    p = _nearest_existing(Path(os.fsdecode(filename)).absolute())
    return None if p.is_dir() else p


def _nearest_existing(p: Path) -> Path:
    """p, or its nearest parent that exists (an absolute path: the root at last)."""
    while not p.exists() and p != p.parent:
        p = p.parent
    return p
