"""The tree is as ruff formats it and lints clean (pyproject's [tool.ruff]): CI fails on a diff.

ruff is pinned in the `test` extra, since a formatter's output changes between releases. To fix a
failure: `ruff format . && ruff check --fix .`, then commit what remains to be fixed by hand."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize(
    "args", [("format", "--check", "--diff", "."), ("check", "--no-fix", "--output-format", "concise", ".")]
)
def test_tree_is_as_ruff_leaves_it(args):
    r = ruff(*args)
    assert r.returncode == 0, f"ruff {' '.join(args)}:\n{r.stdout[-4000:]}{r.stderr[-2000:]}"


def test_a_diff_fails(tmp_path):
    """The check is not vacuous: an unformatted file and an unsorted import are reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nimport os\nx=[1,2 ,3]\n")
    fmt = ruff("format", "--check", str(bad))
    lint = ruff("check", "--no-fix", "--select", "I", str(bad))
    assert fmt.returncode == 1 and "bad.py" in fmt.stdout
    assert lint.returncode == 1 and "I001" in lint.stdout
