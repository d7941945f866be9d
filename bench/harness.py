"""The one harness every bench script uses: its command line, timing, peak memory and result file.

A bench is a module run from the repository root as `python -m bench.NAME ...` (so it imports the
project as it is checked out, with no path set-up of its own). It builds its parser with `parser`,
times with `medians`, measures peak memory with `in_child` (one way for all: the peak resident set
of a fresh child process while the function ran, from its VmHWM, never the bench's own), and ends
with `emit`, which prints the result and writes it only where --json names a file, never over an
existing one unless --force is given: `parse` refuses such a --json before anything is measured.
Each script lists, in `TOY`, the argument lists that run it at toy size; `pytest -m bench`
(tests/test_bench.py) runs them all.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


DEFAULTS = {"json": None, "force": False, "toy": False, "threads": 1}  # the shared flags' values when not given


def parser(doc: str | None, *, given_only: bool = False) -> argparse.ArgumentParser:
    """The script's parser (its docstring as the help), with the flags every bench shares; given_only:
    they set nothing unless given (a subcommand's copy, so as not to overwrite the main parser's;
    `parse` fills in DEFAULTS for those given nowhere)."""

    def default(name: str):
        return argparse.SUPPRESS if given_only else DEFAULTS[name]

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--json",
        metavar="PATH",
        type=result_path,
        default=default("json"),
        help="Also write the result to PATH (refused if it exists, unless --force).",
    )
    p.add_argument(
        "--force",
        action="store_true",
        default=default("force"),
        help="Let --json replace an earlier result (a committed one): never a file that is no bench result.",
    )
    p.add_argument(
        "--toy",
        action="store_true",
        default=default("toy"),
        help="Run at toy size: seconds, to check the script works.",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=default("threads"),
        help="torch intra-op threads (1: two threads thrash when shared).",
    )
    return p


def result_path(text: str) -> str:
    """--json's PATH, checked as the command line is read: an existing file there must be an earlier
    result (JSON, not a file of a store, a run, a report or a checkpoint), the only thing --force replaces."""
    from stages.out_contents import KINDS, enclosing_store

    path = Path(text)
    if not path.exists():
        return text
    store = enclosing_store(path)
    kind = next((k for k in KINDS if k.marked([path.name])), None)
    why = (
        "is a directory"
        if path.is_dir()
        else f"lies inside the hidden-state store {store}"
        if store
        else f"is a file of {kind.what}"
        if kind
        else None
    )
    if why is None:
        try:
            json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            why = "is not JSON"
    if why:
        raise argparse.ArgumentTypeError(
            f"{path} {why}: --json writes a bench result, replacing only an earlier one; choose another path"
        )
    return text


def parse(p: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, parsed; a --json onto an existing file without --force is refused at once, in
    one line, not after the measurement (minutes) has run."""
    args = p.parse_args(argv)
    for name, value in DEFAULTS.items():  # a subcommand's shared flags, given nowhere
        if name not in vars(args):
            setattr(args, name, value)
    json_path = getattr(args, "json", None)
    if json_path:
        _writable(Path(json_path), getattr(args, "force", False))
    return args


def _writable(path: Path, force: bool) -> None:
    if path.exists() and not force:
        sys.exit(f"error: {path} exists (a committed result?); pass --force to replace it")


def subcommand(subs, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand's parser (of `subs`, from add_subparsers) with the shared flags, given after its name
    or before it (`--toy capture` once kept the subcommand's default and ran the full-size capture)."""
    shared = parser(None, given_only=True)
    return subs.add_parser(name, help=help, description=help, parents=[shared], conflict_handler="resolve")


def torch_setup(threads: int) -> None:
    """What every torch process of a bench does first: its thread count, and denormals flushed."""
    import torch

    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)


def medians(fn, repeat: int, *, warmup: int = 0) -> dict:
    """Call fn() warmup + repeat times; the seconds of the timed calls and their median."""
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(runs), "runs_s": runs}


def median_of(values) -> float:
    return statistics.median(list(values))


def _vm_hwm() -> int:
    """This process's peak resident set in bytes (VmHWM: of its own address space, unlike ru_maxrss,
    which a spawned child inherits from the process it was forked from)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _child(conn, fn, args, kwargs) -> None:
    Path("/proc/self/clear_refs").write_text("5")  # the peak so far (imports) reset to what is resident now
    start = _vm_hwm()
    try:
        result = fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - handed to the parent, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", (result, start, _vm_hwm())))


def in_child(fn, *args, **kwargs) -> tuple[object, dict]:
    """fn(*args, **kwargs) in a fresh (spawned) process: its result, and {"start_rss_bytes": what the
    child held resident when fn began (its imports included), "peak_rss_bytes": its peak while fn
    ran}. fn must be a module-level function and its result picklable."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, fn, args, kwargs))
    proc.start()
    child.close()
    status, payload = parent.recv()
    proc.join()
    if status != "ok":
        raise RuntimeError(f"bench child failed: {payload}")
    result, start, peak = payload
    return result, {"start_rss_bytes": start, "peak_rss_bytes": peak}


def python(*args: str) -> list[str]:
    """argv that runs this interpreter with args (a module or script of the repository)."""
    return [sys.executable, *args]


def emit(result: dict, args: argparse.Namespace) -> None:
    """Print the result as JSON; write it to --json PATH when given (an existing file only with --force)."""
    text = json.dumps(result, indent=1)
    print(text)
    if not args.json:
        return
    path = Path(args.json)
    _writable(path, args.force)  # checked again: the file may have appeared while the bench ran
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
