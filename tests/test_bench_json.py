"""A bench's --json onto an existing file (a committed result) without --force is refused before the
bench measures anything, in one line, for every bench script (bench/harness.parse): one run a script,
its first toy argument list with --json naming a file that exists. No store or checkpoint is needed:
the refusal comes first."""

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tests.test_bench import toy_runs

FIRST = {module: args for module, args in reversed(toy_runs())}  # each script's first toy run


@pytest.mark.parametrize("module", sorted(FIRST))
def test_an_existing_json_is_refused_before_measuring(module, tmp_path):
    result = tmp_path / "result.json"
    result.write_text('{"kept": true}\n')
    fill = {k: tmp_path / k for k in ("store", "fp8_store", "checkpoint", "tmp")}
    argv = [
        sys.executable,
        "-m",
        f"bench.{module}",
        *[a.format(**fill) for a in FIRST[module]],
        "--toy",
        "--json",
        str(result),
    ]
    t0 = time.monotonic()
    r = subprocess.run(
        argv, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300
    )
    assert (r.returncode, r.stdout, r.stderr) == (
        1,
        "",
        f"error: {result} exists (a committed result?); pass --force to replace it\n",
    )
    assert result.read_text() == '{"kept": true}\n'
    assert time.monotonic() - t0 < 60  # the imports, not a measurement
