"""The house: every module imports only from its own layer or those below, entry points stay thin,
and production code carries no test hooks.

    store/ errors                           0  the on-disk format: its errors, under all of it,
    store/format/, store/io/                0.1  what the bytes mean, how they move (neither
                                                 imports the other),
    store/ readers and writers              0.2  the store opened to read or write, above both
    pipeline/ errors, device, fingerprint,  1  the domain: its shared rooms,
              prompts
    pipeline/target/, pipeline/drafter/     2    the two models (neither imports the other),
    pipeline/decode/                        3    decoding with both
    stages/ settings, command, plots        4  what the runs share,
    stages/extract/, train/, evaluate/,     5    the three runs and export (none imports another)
           export/
    train.py, evaluate.py, pipeline/cli.py,
    pipeline/__main__.py                    6  entry points: parse, build the config, run; at most
                                               40 lines per command they define

A store is opened to write (store.store_writer) by extraction alone; every other room reads it.
Beside the layers, bench/ (the lab: it measures) and tools/ (the project's maintenance scripts) never
import each other, at any depth; what both read lives beside them (recipe_results.py).
"""

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import REPO

ENTRY = {"train.py", "evaluate.py", "pipeline/cli.py", "pipeline/__main__.py"}
SIBLINGS = {"pipeline.target", "pipeline.drafter", "stages.extract", "stages.train", "stages.evaluate", "stages.export"}
LINES_PER_COMMAND = 40
STORE_ROOMS = {"store.format", "store.io"}  # side by side: neither imports the other
STORE_LEAVES = {"store.errors"}  # below both
SIBLING_RANKS = (0.1, 2, 5)  # the ranks whose rooms are kept apart from each other
WRITER, WRITERS = "store.store_writer", {"store", "stages.extract"}  # the rooms that may open a store to write
APART = ("bench", "tools")  # the lab and the maintenance scripts: neither imports the other


def room(module: str) -> tuple[str, float]:
    """(room, rank) of a dotted module name: the room is the package rooms are kept apart by."""
    parts = module.split(".")
    top, sub = parts[0], ".".join(parts[:2])
    if module in {"pipeline.cli", "pipeline.__main__", "train", "evaluate"}:
        return module, 6
    if top == "store":
        if sub in STORE_ROOMS:
            return sub, 0.1
        return ("store.leaves", 0) if sub in STORE_LEAVES else ("store", 0.2)
    if top == "pipeline":
        return (sub, 3 if sub == "pipeline.decode" else 2) if sub in SIBLINGS | {"pipeline.decode"} else ("pipeline", 1)
    if top == "stages":
        return (sub, 5) if sub in SIBLINGS else ("stages", 4)
    return top, -1  # not ours


def module_of(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import, at any depth (function-level imports included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def production_files(root: Path) -> list[Path]:
    files = [root / "train.py", root / "evaluate.py"]
    for top in ("store", "pipeline", "stages"):
        files += sorted((root / top).rglob("*.py"))
    return [f for f in files if f.exists()]


def names_in(folder: Path) -> set[str]:
    """The top-level names a module of folder is imported by once folder is on sys.path (as tools/ scripts
    import their siblings): its .py files and its folders."""
    if not folder.is_dir():
        return set()
    return {p.stem for p in folder.glob("*.py")} | {p.name for p in folder.iterdir() if p.is_dir()} - {"__pycache__"}


def kept_apart(root: Path) -> list[str]:
    """Every import of tools/ by bench/ and of bench/ by tools/: as a package (`tools.s3.latency_proxy`) or
    by a module's own name with the other folder on sys.path (`import recipe_bench`)."""
    bad = []
    for me, other in (APART, APART[::-1]):
        theirs = {other} | (names_in(root / other) - names_in(root / me))
        for path in sorted((root / me).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            bad += [
                f"{rel}:{line} imports {target} ({me}/ and {other}/ never import each other)"
                for line, target in imports(path)
                if target.split(".")[0] in theirs
            ]
    return bad


def violations(root: Path) -> list[str]:
    bad = kept_apart(root)
    for path in production_files(root):
        me = module_of(path, root)
        my_room, my_rank = room(me)
        rel = path.relative_to(root).as_posix()
        for line, target in imports(path):
            their_room, their_rank = room(target)
            if their_rank < 0 or their_room == my_room:
                continue
            if their_rank > my_rank or (their_rank == my_rank and my_rank in SIBLING_RANKS):
                bad.append(f"{rel}:{line} imports {target} ({their_room} is not below {my_room})")
            if (target == WRITER or target.startswith(WRITER + ".")) and my_room not in WRITERS:
                bad.append(f"{rel}:{line} imports {target} (only extraction writes a store)")
        text = path.read_text()
        lines, commands = len(text.splitlines()), max(1, len(re.findall(r"^@[\w.]*command\(", text, re.M)))
        if rel in ENTRY and lines > LINES_PER_COMMAND * commands:
            bad.append(
                f"{rel}: entry point of {lines} lines for {commands} command(s) (> {LINES_PER_COMMAND} per command)"
            )
        if "DFLASH_TEST" in text:
            bad.append(f"{rel}: test hook in production code")
    return bad


def test_the_house_holds():
    assert violations(REPO) == []


@pytest.mark.parametrize(
    "where,code,needle",
    [
        (
            "store/x.py",
            "from pipeline.errors import DrafterError\n",
            "store/x.py:1 imports pipeline.errors.DrafterError",
        ),
        ("store/format/x.py", "from store.io import locks\n", "store/format/x.py:1 imports store.io.locks"),
        ("store/io/x.py", "def f():\n    from store.format.layout import shard_group\n", "store/io/x.py:2"),
        (
            "store/format/x.py",
            "from store.hidden_store import HiddenStore\n",
            "store/format/x.py:1 imports store.hidden_store",
        ),
        ("store/errors.py", "from store.format import layout\n", "store/errors.py:1"),
        ("pipeline/drafter/x.py", "def f():\n    from pipeline.target import taps\n", "pipeline/drafter/x.py:2"),
        ("pipeline/target/x.py", "import stages.settings\n", "imports stages.settings"),
        ("stages/train/x.py", "from stages.evaluate.run import run\n", "stages/train/x.py:1"),
        ("stages/export/x.py", "from stages.train import run_dir\n", "stages/export/x.py:1"),
        ("stages/evaluate/x.py", "from store.store_writer import StoreWriter\n", "only extraction writes a store"),
        ("pipeline/x.py", "import store.store_writer\n", "only extraction writes a store"),
        ("stages/extract/x.py", "import os\nV = os.environ.get('DFLASH_TEST_STOP')\n", "test hook"),
        ("train.py", "\n" * 41, "entry point of 41 lines for 1 command(s)"),
        (
            "pipeline/cli.py",
            "@cli.command()\ndef a(): pass\n" * 2 + "\n" * 77,
            "entry point of 81 lines for 2 command(s)",
        ),
        (
            "bench/x.py",
            "from tools.s3.latency_proxy import LatencyProxy\n",
            "bench/x.py:1 imports tools.s3.latency_proxy",
        ),
        (
            "tools/x.py",
            "def f():\n    from bench.recipe_bench import table\n",
            "tools/x.py:2 imports bench.recipe_bench",
        ),
        ("tools/s3/x.py", "import bench.harness\n", "(tools/ and bench/ never import each other)"),
    ],
)
def test_the_check_catches_what_it_forbids(tmp_path, where, code, needle):
    path = tmp_path / where
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(code)
    assert any(needle in v for v in violations(tmp_path)), violations(tmp_path)


def runtime_imports(path: Path) -> set[str]:
    """The modules `path` imports when it runs, at any depth, leaving out `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def import_loops(root: Path) -> list[list[str]]:
    """Every set of production modules that import each other at run time, directly or round a loop."""
    modules = {module_of(p, root): p for p in production_files(root)}
    graph = {m: {t for t in runtime_imports(p) if t in modules and t != m} for m, p in modules.items()}
    reach = {m: _reach(graph, m) for m in graph}
    loops = {tuple(sorted({m} | {o for o in reach[m] if m in reach[o]})) for m in graph if m in reach[m]}
    return sorted(list(loop) for loop in loops)


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    reach, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - reach:
            reach.add(nxt)
            todo.append(nxt)
    return reach


def test_no_import_loop_at_run_time():
    assert import_loops(REPO) == []


def test_the_loop_check_finds_one_in_a_function_and_not_under_type_checking(tmp_path):
    (tmp_path / "store").mkdir()
    (tmp_path / "store/a.py").write_text("from store.b import f\n")
    (tmp_path / "store/b.py").write_text("def f():\n    from store.a import g\n")
    (tmp_path / "store/c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from store.a import g\n"
    )
    (tmp_path / "store/d.py").write_text("from store.c import x\n")
    assert import_loops(tmp_path) == [["store.a", "store.b"]]
    (tmp_path / "store/c.py").write_text("from store.d import y\n")
    assert import_loops(tmp_path) == [["store.a", "store.b"], ["store.c", "store.d"]]


def test_bench_and_tools_reached_by_a_path_of_their_own_are_caught_too(tmp_path):
    """A tools/ script puts a folder on sys.path and imports its module by name (as it imports its siblings)."""
    for where, code in [
        ("bench/recipe_bench.py", "from recipe_results import table\n"),
        ("bench/harness.py", ""),
        ("tools/doc_tables.py", "import stdlib_corpus\nimport recipe_bench\n"),
        ("tools/stdlib_corpus.py", ""),
        ("tools/s3/latency_proxy.py", ""),
        ("bench/s3_bench.py", "def proxied():\n    from s3.latency_proxy import LatencyProxy\n"),
    ]:
        (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / where).write_text(code)
    assert kept_apart(tmp_path) == [
        "bench/s3_bench.py:2 imports s3.latency_proxy.LatencyProxy (bench/ and tools/ never import each other)",
        "tools/doc_tables.py:2 imports recipe_bench (tools/ and bench/ never import each other)",
    ]
