"""Chat-framed Python functions from the standard library: the tiny target's corpus and prompts.

Every function with a body is split into a header (decorators, signature, docstring) and a body.
The user turn asks to complete the header; the assistant turn is the body. Functions whose
qualified name hashes into the held-out bucket never reach training; the shipped prompt set is
drawn from them, so the target's greedy completions are its own work, not recall.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Tests, vendored and generated code, and tkinter/turtle, whose hundreds of near-identical
# `return self.tk.call(self._w, ...)` one-liners teach a small model a greedy loop.
SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "site-packages",
    "lib2to3",
    "turtledemo",
    "__pycache__",
    "ensurepip",
    "tkinter",
}
SKIP_FILES = {"turtle.py"}
HELDOUT_BUCKETS = 8  # 1 in 8 functions is held out
USER_TEMPLATE = "Complete this Python function.\n{header}"


@dataclass(frozen=True)
class Function:
    name: str  # "module:qualname"
    header: str
    body: str

    @property
    def heldout(self) -> bool:
        digest = hashlib.sha1(self.name.encode()).digest()
        return digest[0] % HELDOUT_BUCKETS == 0

    def messages(self) -> list[dict]:
        return [
            {"role": "user", "content": USER_TEMPLATE.format(header=self.header)},
            {"role": "assistant", "content": self.body},
        ]


def stdlib_files(root: Path | None = None) -> list[Path]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if not SKIP_DIRS & set(p.relative_to(root).parts[:-1]) and p.name not in SKIP_FILES
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _functions_in(path: Path, module: str) -> list[Function]:
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = source.splitlines()
    out: list[Function] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                split = _split(child, lines)
                if split is not None:
                    out.append(Function(f"{module}:{prefix}{child.name}", *split))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return out


def _split(fn: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> tuple[str, str] | None:
    start = min([d.lineno for d in fn.decorator_list] + [fn.lineno]) - 1
    body = fn.body
    first = body[0]
    has_doc = (
        isinstance(first, ast.Expr)
        and isinstance(getattr(first, "value", None), ast.Constant)
        and isinstance(first.value.value, str)
    )
    if has_doc:
        body = body[1:]
        head_end = first.end_lineno
    else:
        head_end = first.lineno - 1
    if not body or head_end <= start or body[0].lineno - 1 < head_end:
        return None  # one-liners and bodies sharing the header line
    header = "\n".join(lines[start:head_end])
    body_text = "\n".join(
        lines[body[0].lineno - 1 - _leading_comments(lines, body[0].lineno - 1, head_end) : fn.end_lineno]
    )
    if not body_text.strip():
        return None
    return header, body_text


def _leading_comments(lines: list[str], first_body: int, head_end: int) -> int:
    n = 0
    while first_body - n - 1 >= head_end and lines[first_body - n - 1].strip().startswith("#"):
        n += 1
    return n


def collect(root: Path | None = None) -> list[Function]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out: list[Function] = []
    for path in stdlib_files(root):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        out.extend(_functions_in(path, module))
    return out
