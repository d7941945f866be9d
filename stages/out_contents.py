"""What an output directory holds, as a command that would write there names it.

Before train.py, evaluate.py or `pipeline export` writes its directory it looks at what is there:
nothing, its own earlier output (a run, a report, an export), or something else: a hidden-state
store, another command's output, files it does not know. --force (evaluate.py, export) replaces
only the command's own earlier output; anything else is refused in one line saying what the
directory holds, and a path inside a store is refused too. What each command's directory holds at
its top level is declared here, once, so that every command recognises the others'.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from store.errors import ConfigError

RUN_LOCK = ".train.lock"  # held by the main process of the run writing OUT (stages/out_dir.claim)
LAUNCH_MARK = ".launch"  # written by train.py's main process at start-up; every rank must read it (a shared OUT)
SCHEDULE = "shards.json"  # train.py --follow, --shard-schedule: every epoch's shards (stages/train/shard_schedule.py)
REPORT_FILES = ("report.json", "report.md", "histogram.png", "per_slot.png")  # what evaluate.py writes in OUT
REPORT_LOCK = ".evaluate.lock"  # held by the evaluate.py writing OUT


@dataclass(frozen=True, kw_only=True)
class Kind:
    """One kind of directory this tool writes, known by the entries only it writes at the top level."""

    what: str  # as a refusal says it: "a hidden-state store"
    marks: tuple[str, ...]
    pattern: str = r"(?!)"  # further marks (fullmatch): step-N, temporaries; by default none

    def __post_init__(self) -> None:
        assert self.what and self.marks, self

    def marked(self, names: list[str]) -> list[str]:
        """Those of `names` (entries, a directory's ending in '/') that are this kind's."""
        known = sorted((n for n in names if n.rstrip("/") in self.marks), key=lambda n: self.marks.index(n.rstrip("/")))
        return known + [n for n in names if re.fullmatch(self.pattern, n.rstrip("/")) and n not in known]


STORE = Kind(what="a hidden-state store", marks=("zarr.json", "shards", "_commits", "_locks", "_index"))
RUN = Kind(
    what="a training run",
    marks=("metrics.jsonl", "final", SCHEDULE, "curve.png", "audit", RUN_LOCK, LAUNCH_MARK),
    pattern=r"\.?step-\d+(\.tmp)?|\.final\.(tmp|old)\d+|\.shards\.json\.tmp",
)
REPORT = Kind(what="an evaluate.py report", marks=(*REPORT_FILES, REPORT_LOCK), pattern=r"\.report\.(json|md)\.tmp\d+")
DRAFTER = Kind(
    what="a drafter checkpoint",
    marks=("config.json", "model.safetensors", "modeling_dflash.py", "trainer_state.json", "training"),
)
KINDS = (STORE, RUN, REPORT, DRAFTER)


def entries(directory: Path) -> list[str]:
    """DIRECTORY's entries, sorted, a directory's ending in '/'; none when it is not a directory."""
    try:
        return sorted(p.name + ("/" if p.is_dir() else "") for p in Path(directory).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def described(names: list[str], command: str) -> str:
    """What a directory of these entries is, as a refusal says it: 'is a hidden-state store (zarr.json,
    shards/)', or 'holds files COMMAND did not write (...)' when it is no kind this tool writes."""
    for kind in KINDS:
        marked = kind.marked(names)
        if marked:
            return f"is {kind.what} ({_listed(marked)})"
    return f"holds files {command} did not write ({_listed(names)})"


def _listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def enclosing_store(path: str | Path) -> Path | None:
    """The hidden-state store PATH is or lies in (the nearest one of PATH and its parents), or None."""
    p = Path(path).absolute()
    return next((d for d in (p, *p.parents) if _is_store(d)), None)


def _is_store(d: Path) -> bool:
    try:
        return (d / "zarr.json").is_file() and ((d / "_commits").is_dir() or (d / "shards").is_dir())
    except OSError:  # a directory this user may not look into: the refusal comes where it is written
        return False


def refuse_a_store(path: str | Path, flag: str, shown: str | Path | None = None) -> None:
    """A ConfigError naming flag when PATH is a store or lies inside one: no command writes its output there."""
    store = enclosing_store(path)
    if store is None:
        return
    value = shown if shown is not None else path
    where = (
        described(entries(store), "")
        if store == Path(path).absolute()
        else f"lies inside the hidden-state store {store}"
    )
    raise ConfigError(flag, value, f"{where}: no command writes its output into a store; choose a directory outside it")


def refuse_other_kinds(directory: Path, own: Kind, flag: str, writes: str, mine: tuple[str, ...] = ()) -> None:
    """Refused (ConfigError) when DIRECTORY, not yet `own`'s, is another kind this tool writes (a store,
    a run, a report, a drafter checkpoint); files of no kind are left to the command. mine: entries
    this process made itself (its lock)."""
    names = [n for n in entries(directory) if n not in mine]
    if own.marked(names):
        return
    for kind in KINDS:
        if kind is not own and kind.marked(names):
            raise ConfigError(
                flag, directory, f"is {kind.what} ({_listed(kind.marked(names))}): {writes}; choose another {flag}"
            )


@dataclass(frozen=True, kw_only=True)
class Output:
    """What one command writes in its directory, to replace it only there: `files` (an earlier
    output, replaced only with --force; `whole`: it is one only with all of them), `scratch` (its
    lock and temporaries, as a run killed meanwhile leaves them), and how its refusals say it."""

    command: str  # "pipeline export"
    flag: str  # "OUT_DIR"
    files: tuple[str, ...]
    earlier: str  # "an earlier export"
    writes: str  # "export writes a serving checkpoint into an empty directory or one holding an earlier export"
    whole: bool = False
    scratch: Kind | None = None

    def __post_init__(self) -> None:
        assert self.files and self.flag and self.command, self

    def check(self, directory: Path, force: bool, shown: str | Path | None = None, mine: tuple[str, ...] = ()) -> None:
        """Refused (ConfigError) unless DIRECTORY is absent, empty or holds only this command's earlier
        output, which it replaces only with `force`. mine: entries this process made itself (its lock)."""
        names = [n for n in entries(directory) if n not in mine]
        scratch = self.scratch.marked(names) if self.scratch else []
        own = [f for f in self.files if f in names]
        foreign = [n for n in names if n not in self.files and n not in scratch]
        complete = not self.whole or len(own) in (0, len(self.files))
        value = shown if shown is not None else directory
        if foreign or not complete:
            what = described(foreign if own and complete else names, self.command)
            raise ConfigError(self.flag, value, f"{what}: {self.writes}; choose another {self.flag}")
        if own and not force:
            raise ConfigError(
                self.flag,
                value,
                f"already holds {self.earlier} ({', '.join(own)}); pass --force to "
                f"replace it, or choose another {self.flag}",
            )
