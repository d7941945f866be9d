"""transformers' fla dispatch on any CPU, as a GPU runs it: a `pipeline` command with the stand-in
fla of tests/standin_packages first on the path (the naive gated delta rule, counting its calls)
and fla's device list in transformers widened to cpu by the interpreter shims
(tools/engines/fla_interpret/sitecustomize.py): since 5.25 transformers sends CPU tensors to its
PyTorch path whatever is installed. TRITON_INTERPRET=1 lets the pipeline choose fla without CUDA,
and the harness tells it that fla is installed without triton (the stand-in needs none; a stand-in
triton on the path would break torch's own imports).

    python -m tests.fla_standin extract --store ... --linear-attention fla

writes the stand-in's calls as JSON to $DFLASH_STANDIN_CALLS when the command ends.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = REPO / "tests" / "standin_packages"
SHIMS = REPO / "tools" / "engines" / "fla_interpret"  # its sitecustomize widens fla's device list to cpu


def run(args: list[str], calls: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`pipeline ARGS` under the stand-in in a subprocess, one thread; its fla calls land in `calls`."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": f"{SHIMS}{os.pathsep}{REPO}",
        "DFLASH_STANDIN_CALLS": str(calls),
    }
    return subprocess.run(
        [sys.executable, "-m", "tests.fla_standin", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def write_calls() -> None:
    module = sys.modules.get("fla.ops.gated_delta_rule")
    calls = dict(module.CALLS) if module is not None else {}
    Path(os.environ["DFLASH_STANDIN_CALLS"]).write_text(json.dumps(calls))


def main(argv: list[str]) -> None:
    sys.path.insert(0, str(PACKAGES))
    from pipeline.target import kernels

    kernels.fla_installed = lambda: sys.modules.get("fla", ...) is not None  # the stand-in, unless blocked
    atexit.register(write_calls)
    from pipeline.cli import main as cli

    sys.argv = ["pipeline", *argv]
    cli()


if __name__ == "__main__":
    main(sys.argv[1:])
