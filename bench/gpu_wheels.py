"""The wheels a GPU machine without a registry needs, at the versions CI tests (.ci/tested-versions.txt).

    python -m bench.gpu_wheels fetch DIR     # on a machine with a registry: download them into DIR
    python -m bench.gpu_wheels versions      # on the GPU machine: what is installed against the tested versions

`fetch` starts from the libraries stage one, training and evaluation import, downloads each with
`--no-deps` at the version the tested-versions file names, reads the wheel's own requirements for the
GPU machine's platform and follows them until nothing is missing. A requirement the file does not name is
an error: the check must run what a user's install gets, not whatever the registry has today. The image's
CUDA stack (torch, triton, nvidia-*, and numpy, which its torch was built against) is left as it is and
`versions` shows it next to the tested versions.

Standard library only (plus pip's vendored packaging), so it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare interpreter: pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement

TESTED = Path(__file__).resolve().parent.parent / ".ci" / "tested-versions.txt"
ROOTS = (
    "transformers",
    "kernels",
    "flash-linear-attention",
    "accelerate",
    "zarr",
    "numcodecs",
    "safetensors",
    "tqdm",
    "click",
)
IMAGE = re.compile(r"^(torch|triton|numpy|nvidia-.*)$")
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def tested_versions(path: Path = TESTED) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonical(name)] = version.strip()
    return pins


def wheel_requirements(wheel: Path, python: str) -> list[str]:
    """Names the wheel needs on Linux x86_64 under CPython `python` (extras off)."""
    env = {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    names = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(env):
                names.append(canonical(req.name))
    return names


def download(name: str, version: str, into: Path, python: str) -> Path:
    before = set(into.glob("*.whl"))
    platforms = [arg for plat in PLATFORMS for arg in ("--platform", plat)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            python,
            "--implementation",
            "cp",
            *platforms,
            "-d",
            str(into),
            f"{name}=={version}",
        ],
        check=True,
    )
    stem = canonical(name).replace("-", "_")
    found = [
        w
        for w in into.glob("*.whl")
        if canonical(w.name.split("-")[0]).replace("-", "_") == stem and w.name.split("-")[1] == version
    ]
    if not found:
        raise SystemExit(
            f"error: pip fetched no wheel for {name}=={version} (new: {sorted(set(into.glob('*.whl')) - before)})"
        )
    return found[0]


def fetch(into: Path, python: str, *, roots=ROOTS, tested: Path = TESTED) -> list[str]:
    """Download every wheel `roots` need, each at its tested version; returns the `name==version` lines."""
    pins = tested_versions(tested)
    into.mkdir(parents=True, exist_ok=True)
    todo, done = [canonical(r) for r in roots], {}
    while todo:
        name = todo.pop()
        if name in done or IMAGE.match(name):
            continue
        if name not in pins:
            raise SystemExit(f"error: {name} is needed on the GPU machine but {tested} names no version for it")
        done[name] = pins[name]
        todo += wheel_requirements(download(name, pins[name], into, python), python)
    return [f"{name}=={version}" for name, version in sorted(done.items())]


def versions() -> list[str]:
    """One line per distribution the tested file names: installed version, and whether it differs."""
    lines = []
    for name, tested in sorted(tested_versions().items()):
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = "-"
        mark = "" if have == tested else "  (differs)"
        lines.append(f"{name:24} {have:18} tested {tested}{mark}")
    for name in ("torch", "triton"):  # the image's CUDA builds: not in the CPU lane's file
        try:
            lines.append(f"{name:24} {metadata.version(name):18} (the image's)")
        except metadata.PackageNotFoundError:
            lines.append(f"{name:24} {'-':18} (the image's)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    get = sub.add_parser("fetch", help="download the wheels at the tested versions")
    get.add_argument("dir", type=Path, help="where the wheels go (.whl, git-ignored)")
    get.add_argument("--python", default="3.12", help="the GPU machine's CPython version (default 3.12)")
    sub.add_parser("versions", help="installed versions against the tested ones")
    args = parser.parse_args()
    if args.command == "fetch":
        print("\n".join(fetch(args.dir, args.python)))
    else:
        print("\n".join(versions()))


if __name__ == "__main__":
    main()
