"""The fla kernels on CPU under Triton's interpreter, for the opt-in `fla_interpret` tests: their own
venv, built once by tools/engines/build_fla_interpret.sh ($DFLASH_FLA_VENV, default
~/.cache/dflash-pipeline/fla-interpret-venv), and the two harness shims of
tools/engines/fla_interpret/sitecustomize.py (autotuner benchmarks skipped, `for` loop variables made
tensors), which Python loads at start-up from PYTHONPATH."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.conftest import REPO

VENV = Path(os.environ.get("DFLASH_FLA_VENV", Path.home() / ".cache" / "dflash-pipeline" / "fla-interpret-venv"))
SHIMS = REPO / "tools" / "engines" / "fla_interpret"


def build_venv() -> Path:
    subprocess.run(["bash", str(REPO / "tools" / "engines" / "build_fla_interpret.sh"), str(VENV)], check=True)
    return VENV / "bin" / "python"


def env(interpret: bool = True) -> dict:
    """The environment of a process in that venv: the shims on the path, the interpreter on or off."""
    out = {**os.environ, "PYTHONPATH": f"{SHIMS}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "2"}
    out.pop("TRITON_INTERPRET", None)
    if interpret:
        out["TRITON_INTERPRET"] = "1"
    return out


def run(args: list[str], interpret: bool = True, timeout: float = 3600, **kwargs) -> subprocess.CompletedProcess:
    """`python ARGS` in the venv (args[0] a script path or "-c"), output captured."""
    return subprocess.run(
        [str(build_venv()), *args],
        env=env(interpret),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )
