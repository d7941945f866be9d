"""CI's second lane: the tests that lean on library internals, on the newest release of every dependency.

The main lane (README's test command) installs the releases in .ci/tested-versions.txt, so a stop's
change is judged on a fixed set. This lane resolves every dependency to its newest release (torch
stays at the CPU wheel README pins: a newer one is a multi-GB CUDA build), runs the tests that touch
library internals, and fails naming the release that breaks them: each package newer than the tested
one is set back to its tested release in turn, and the one whose setting back makes the failed tests
pass is named. Standard library only.

    python .ci/newest_lane.py            # the lane (CI runs it after the main lane)
    python .ci/newest_lane.py --freeze   # after it passes: record the newest releases as the tested ones
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTED = REPO / ".ci" / "tested-versions.txt"
VENV = REPO / ".venv-newest"
TORCH = "torch==2.13.0"  # as README's commands: the CPU wheel
NOT_LOCKED = {"torch", "pip", "setuptools", "wheel", "dflash-pipeline"}
# The tests that touch library internals: capture and kernels, cache and verifier (transformers),
# chat templates and tokenizers, drafter modeling and checkpoints, export, zarr codecs and the store,
# datasets rows, accelerate launch (training's DDP and resume tests).
TESTS = ["tests/pipeline/target", "tests/pipeline/drafter", "tests/pipeline/decode/test_live.py",
         "tests/pipeline/test_chat_template.py", "tests/pipeline/test_row_sources.py", "tests/store",
         "tests/stages/test_extract.py", "tests/stages/test_export.py", "tests/stages/test_train.py"]


def main(argv: list[str]) -> int:
    fresh_venv()
    newest = installed()
    if "--freeze" in argv:
        return freeze(newest)
    moved = changes(read_tested(), newest)
    say(f"{len(newest)} packages resolved; " + (
        "newer than .ci/tested-versions.txt: " + ", ".join(describe(n, old, new) for n, (old, new) in moved.items())
        if moved else "every one is the tested release"))
    if pytest() == 0:
        say("passed" + (f" on {len(moved)} newer release(s); record them with `python .ci/newest_lane.py --freeze`"
                        if moved else ""))
        return 0
    culprits = [name for name, (old, _new) in moved.items() if old is not None and passes_with(name, old)]
    if culprits:
        say("FAILED: " + "; ".join(f"{describe(n, *moved[n])} breaks the tests above (they pass with {moved[n][0]})"
                                   for n in culprits))
    elif moved:
        say("FAILED with " + ", ".join(describe(n, old, new) for n, (old, new) in moved.items())
            + ": no one of them set back to its tested release makes the failed tests pass")
    else:
        say("FAILED on the tested releases themselves (see the tests above)")
    return 1


def fresh_venv() -> None:
    shutil.rmtree(VENV, ignore_errors=True)
    run([sys.executable, "-m", "venv", str(VENV)])
    pip("install", "--no-compile", TORCH)
    # TORCH again: an eager upgrade would otherwise take the newest torch, a CUDA build with triton
    pip("install", "--no-compile", "--upgrade", "--upgrade-strategy", "eager", "-e", ".[test]", TORCH)


def installed() -> dict[str, str]:
    out = subprocess.run([str(VENV / "bin" / "pip"), "freeze", "--exclude-editable"], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    return {norm(name): version for name, version in pins(out) if norm(name) not in NOT_LOCKED}


def read_tested() -> dict[str, str]:
    return {norm(name): version for name, version in pins(TESTED.read_text())}


def pins(text: str):
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            yield name.strip(), version.strip()


def norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def changes(tested: dict, newest: dict) -> dict:
    """name -> (tested release or None when the package is new, newest release), for what differs."""
    return {name: (tested.get(name), version) for name, version in sorted(newest.items())
            if tested.get(name) != version}


def describe(name: str, old: str | None, new: str) -> str:
    return f"{name} {new} ({'tested ' + old if old else 'not in the tested set'})"


def pytest(*extra: str) -> int:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": ""}
    cmd = [str(VENV / "bin" / "python"), "-m", "pytest", "-q", "-n", "auto", "--dist", "worksteal", *extra, *TESTS]
    print("+", " ".join(cmd[1:]), flush=True)
    return subprocess.run(cmd, cwd=REPO, env=env).returncode


def passes_with(name: str, old: str) -> bool:
    """Do the failed tests pass with `name` set back to its tested release (the rest as resolved)?"""
    say(f"trying {name}=={old}")
    new = installed()[name]
    pip("install", "--no-compile", "--no-deps", f"{name}=={old}")
    try:
        return pytest("--last-failed", "--last-failed-no-failures", "none") == 0
    finally:
        pip("install", "--no-compile", "--no-deps", f"{name}=={new}")


def freeze(newest: dict) -> int:
    if pytest() != 0:
        say("not recorded: the tests failed on the newest releases")
        return 1
    lines = [f"{name}=={version}" for name, version in sorted(newest.items())]
    TESTED.write_text("# The releases CI's main lane tests (README's test command installs them with -c).\n"
                      "# Written by `python .ci/newest_lane.py --freeze` after the newest-release lane passed.\n"
                      + "\n".join(lines) + "\n")
    say(f"recorded {len(lines)} releases in {TESTED.relative_to(REPO)}")
    return 0


def pip(*args: str) -> None:
    run([str(VENV / "bin" / "pip"), "-q", *args])


def run(cmd: list[str]) -> None:
    subprocess.run(cmd, cwd=REPO, check=True)


def say(message: str) -> None:
    print(f"newest-release lane: {message}", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
