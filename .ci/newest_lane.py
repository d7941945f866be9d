"""CI's second lane: the tests that lean on library internals, on the newest release of every dependency.

The main lane (README's test command) installs the releases in .ci/tested-versions.txt, so a stop's
change is judged on a fixed set. This lane resolves every dependency to its newest release (torch
stays at the CPU wheel README pins: a newer one is a multi-GB CUDA build), runs the tests that touch
library internals, and fails naming the release that breaks them: each package newer than the tested
one is set back to its tested release in turn, and the one whose setting back makes the failed tests
pass is named. Standard library only.

    python .ci/newest_lane.py            # the lane (CI runs it after the main lane); its tests run only
                                         # when some release is newer than the tested one (--always: anyway)
    python .ci/newest_lane.py --freeze   # after it passes: record the newest releases as the tested ones
    python .ci/newest_lane.py --check-constraints   # the tested releases install with every extra

The lane installs the project with the extras a CPU machine can install (test, s3) and the freeze
records them all, so the constraints hold with `pip install -e '.[test,s3]' -c ...`. Every extra,
`gpu` (triton) included, is also resolved without installing anything (`pip install --dry-run`,
metadata only: no wheel is downloaded) against the constraints: by the freeze before it writes them,
and by CI (.ci/run) before the main lane, which fails naming the conflict. An unpinned package lets pip
backtrack through its old releases for a quarter of an hour (python-dateutil 4.0.0 pinned, botocore
asking for <3: every botocore tried), so every package the resolution brings must be pinned, but
torch (the install commands pin it) and triton (a GPU machine's torch decides it: torch 2.13.0's CUDA
build requires triton==3.7.1).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTED = REPO / ".ci" / "tested-versions.txt"
VENV = REPO / ".venv-newest"
TORCH = "torch==2.13.0"  # as README's commands: the CPU wheel
NOT_LOCKED = {"torch", "pip", "setuptools", "wheel", "dflash-pipeline"}
INSTALLED_EXTRAS = "test,s3"  # what the lane installs; "gpu" (triton) is resolved only, never installed here
FOLLOWS_THE_MACHINE = {"torch", "triton"}  # left unpinned: see the module's doc
RESOLVE_TIMEOUT_S = 300  # a resolution that conflicts only slowly (backtracking) is a failure too
# The tests that touch library internals: capture and kernels, cache and verifier (transformers),
# chat templates and tokenizers, drafter modeling and checkpoints, export, zarr codecs and the store,
# datasets rows, accelerate launch (training's DDP and resume tests).
TESTS = [
    "tests/pipeline/target",
    "tests/pipeline/drafter",
    "tests/pipeline/decode/test_live.py",
    "tests/pipeline/test_chat_template.py",
    "tests/pipeline/test_row_sources.py",
    "tests/store",
    "tests/stages/test_extract.py",
    "tests/stages/test_export.py",
    "tests/stages/test_train.py",
]


def main(argv: list[str]) -> int:
    if "--check-constraints" in argv:
        return check_constraints(TESTED)
    fresh_venv()
    newest = installed()
    if "--freeze" in argv:
        return freeze(newest)
    moved = changes(read_tested(), newest)
    say(
        f"{len(newest)} packages resolved; "
        + (
            "newer than .ci/tested-versions.txt: " + ", ".join(describe(n, old, new) for n, (old, new) in moved.items())
            if moved
            else "every one is the tested release"
        )
    )
    if not moved and "--always" not in argv:
        say("nothing to run: the main lane ran these tests on exactly these releases (--always runs them again)")
        return 0
    if pytest() == 0:
        say(
            "passed"
            + (
                f" on {len(moved)} newer release(s); record them with `python .ci/newest_lane.py --freeze`"
                if moved
                else ""
            )
        )
        return 0
    culprits = [name for name, (old, _new) in moved.items() if old is not None and passes_with(name, old)]
    if culprits:
        say(
            "FAILED: "
            + "; ".join(
                f"{describe(n, *moved[n])} breaks the tests above (they pass with {moved[n][0]})" for n in culprits
            )
        )
    elif moved:
        say(
            "FAILED with "
            + ", ".join(describe(n, old, new) for n, (old, new) in moved.items())
            + ": no one of them set back to its tested release makes the failed tests pass"
        )
    else:
        say("FAILED on the tested releases themselves (see the tests above)")
    return 1


def fresh_venv() -> None:
    shutil.rmtree(VENV, ignore_errors=True)
    run([sys.executable, "-m", "venv", str(VENV)])
    pip("install", "--no-compile", TORCH)
    # TORCH again: an eager upgrade would otherwise take the newest torch, a CUDA build with triton
    pip("install", "--no-compile", "--upgrade", "--upgrade-strategy", "eager", "-e", f".[{INSTALLED_EXTRAS}]", TORCH)


def installed() -> dict[str, str]:
    out = subprocess.run(
        [str(VENV / "bin" / "pip"), "freeze", "--exclude-editable"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
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
    return {
        name: (tested.get(name), version) for name, version in sorted(newest.items()) if tested.get(name) != version
    }


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
    text = (
        "# The releases CI's main lane tests (README's test command installs them with -c).\n"
        "# Written by `python .ci/newest_lane.py --freeze` after the newest-release lane passed;\n"
        "# they install with every extra (`python .ci/newest_lane.py --check-constraints`).\n" + "\n".join(lines) + "\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        candidate = Path(tmp) / "tested-versions.txt"
        candidate.write_text(text)
        if check_constraints(candidate) != 0:
            say("not recorded: these releases do not install together with every extra")
            return 1
    TESTED.write_text(text)
    say(f"recorded {len(lines)} releases in {TESTED.relative_to(REPO)}")
    return 0


def requirements() -> tuple[list[str], list[str]]:
    """(the project's requirements with every extra's, and the extras' names), from pyproject.toml."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    return list(project["dependencies"]) + [r for reqs in extras.values() for r in reqs], sorted(extras)


def conflict(pip_output: str) -> str:
    """What pip says about a failed resolution: its ERROR lines and the requirements that conflict."""
    lines = [ln.strip() for ln in pip_output.splitlines()]
    cause = lines.index("The conflict is caused by:") if "The conflict is caused by:" in lines else len(lines)
    caused = [ln for ln in lines[cause + 1 :] if ln][:8]
    caused = caused[: next((i for i, ln in enumerate(caused) if ln.startswith("To fix")), len(caused))]
    return " | ".join([ln for ln in lines if ln.startswith("ERROR:")][:3] + caused)


def check_constraints(constraints: Path) -> int:
    """Do the project's requirements with every extra, and torch as README pins it, resolve under
    `constraints`, each package to a pinned release? A dry run (metadata only, nothing downloaded
    or installed), stopped after RESOLVE_TIMEOUT_S; 0 when they do, else 1 with what is wrong."""
    reqs, extras = requirements()
    label = f"{constraints.name} with every extra ({', '.join(extras)})"
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--disable-pip-version-check",
            "--report",
            str(report),
            "-c",
            str(constraints),
            TORCH,
            *reqs,
        ]
        t0 = time.monotonic()
        try:
            done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=RESOLVE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            say(
                f"FAILED: {label} did not resolve in {RESOLVE_TIMEOUT_S} s (pip backtracking through old "
                "releases: a pin that a dependency refuses, or an unpinned package)"
            )
            return 1
        if done.returncode != 0:
            say(f"FAILED: {label} do not install together: " + conflict(done.stdout + done.stderr))
            return 1
        resolved = {
            norm(i["metadata"]["name"]): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]
        }
    pinned = {norm(name) for name, _ in pins(constraints.read_text())}
    loose = sorted(set(resolved) - pinned - NOT_LOCKED - FOLLOWS_THE_MACHINE)
    if loose:
        say(
            f"FAILED: {label}: not pinned (pip may backtrack through every old release of them): "
            + ", ".join(f"{n} (resolved {resolved[n]})" for n in loose)
        )
        return 1
    say(f"{label}: {len(resolved)} packages resolve, every one pinned ({time.monotonic() - t0:.0f} s)")
    return 0


def pip(*args: str) -> None:
    run([str(VENV / "bin" / "pip"), "-q", *args])


def run(cmd: list[str]) -> None:
    subprocess.run(cmd, cwd=REPO, check=True)


def say(message: str) -> None:
    print(f"newest-release lane: {message}", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
