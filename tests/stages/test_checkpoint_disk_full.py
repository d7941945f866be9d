"""A checkpoint that cannot be written because the disk is full, a quota is spent or a file-size limit
is reached, in a real train.py as a user runs it: one `error:` line naming the checkpoint's path and
the fix, exit code 2, no traceback, and nothing of the checkpoint left (no .step-N.tmp, no
.final.tmp); then the same command with --resume, once there is room, finishes the run. The writers'
own errors lose the path and the errno (safetensors: `os error 28`; torch's zip writer: 'unexpected
pos'), so this is tested on real writes: under RLIMIT_FSIZE (EFBIG), and on a small tmpfs (ENOSPC)
mounted in a private mount namespace where the machine allows one (`unshare`)."""

import os
import resource
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.processes import TINY

STEPS = {"step-2": ["--save-every", 2], "final": ["--save-every", 0]}  # the checkpoint that fills the disk


def args(store, out, which: str) -> list[str]:
    return [
        "train.py",
        "--store",
        str(store),
        "--out",
        str(out),
        "--shards",
        "0-2",
        "--max-steps",
        "2",
        "--threads",
        "1",
        *map(str, STEPS[which]),
        *TINY,
        "--workers",
        "0",
    ]  # workers: shared memory is
    # written as files, which the file-size limit would refuse too


def run(cmd: list[str], limit: int | None = None) -> subprocess.CompletedProcess:
    def limited():
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, preexec_fn=limited)


def one_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and r.stderr.rstrip("\n").endswith(errors[0]), r.stderr[-3000:]
    return errors[0]


def hidden(out) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith(".")) if out.exists() else []


def where(out, which: str) -> str:
    return str(out / (".step-2.tmp" if which == "step-2" else "final"))


@pytest.mark.parametrize("which", list(STEPS))
def test_a_file_size_limit_while_saving_is_one_line_and_leaves_nothing(which, small_store, tmp_path):
    out = tmp_path / "run"
    line = one_line(run([sys.executable, *args(small_store, out, which)], limit=300_000))  # a drafter file: ~590 kB
    assert line.startswith(
        f"error: {where(out, which)}: file too large while saving the checkpoint of step 2; "
        "nothing of it is kept; raise the file-size limit (`ulimit -f`), then rerun the same command "
        "with --resume"
    ), line
    assert hidden(out) == []
    again = run([sys.executable, *args(small_store, out, which), "--resume"])
    assert again.returncode == 0 and (out / "final" / "model.safetensors").exists(), again.stderr[-3000:]
    assert hidden(out) == []


def test_a_full_disk_while_saving_is_one_line_and_leaves_nothing(small_store, tmp_path):
    if shutil.which("unshare") is None or run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("no private mount namespace here for a small tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / "run"
    for which in STEPS:
        script = (
            f'mount -t tmpfs -o size=400k tmpfs {disk} && {{ {sys.executable} "$@"; rc=$?; '
            f"echo LEFT: $(ls -A {out} 2>/dev/null); exit $rc; }}"
        )  # the disk goes with the namespace
        r = run(["unshare", "-rm", "sh", "-c", script, "sh", *args(small_store, out, which)])
        line = one_line(r)
        assert line.startswith(
            f"error: {where(out, which)}: no space left on device while saving the checkpoint of "
            f"step 2; nothing of it is kept; free space on {out}'s file system"
        ), line
        left = r.stdout.splitlines()[-1].split()[1:]
        assert not [name for name in left if name.startswith(".")], left
