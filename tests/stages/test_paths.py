"""stages/paths.py: output directories made and checked before the work, the file system's refusals
named in one line, internal errors left alone."""

import errno
import os
from pathlib import Path

import pytest

from stages.paths import describe, output_dir, refusal
from store.errors import ConfigError


def test_an_output_directory_is_made_with_its_parents_and_left_clean(tmp_path):
    out = output_dir(tmp_path / "a" / "b", "--out")
    assert out.is_dir() and list(out.iterdir()) == []
    assert output_dir(out, "--out") == out  # an existing one is fine


@pytest.mark.parametrize(
    "code,said",
    [
        (errno.EACCES, "permission denied; choose a path you may write, or change its permissions"),
        (errno.EROFS, "read-only file system; choose a path on a writable file system"),
        (errno.EDQUOT, "disk quota exceeded; free space within your quota, or choose another file system"),
    ],
)
def test_a_directory_it_may_not_write_is_refused_naming_the_flag(monkeypatch, tmp_path, code, said):
    """What root cannot see with chmod (tests/test_errors.py runs that for real when not root)."""

    def refuse(self, *a, **k):
        raise OSError(code, os.strerror(code), str(self))

    monkeypatch.setattr(Path, "touch", refuse)
    with pytest.raises(ConfigError) as e:
        output_dir(tmp_path / "out", "--out")
    probe = tmp_path / "out" / f".write-check-{os.getpid()}"
    assert str(e.value) == f"--out {tmp_path / 'out'}: cannot be written: {probe}: {said}"


def test_a_file_in_the_way_is_named(tmp_path):
    blocker = tmp_path / "f"
    blocker.write_text("")
    with pytest.raises(
        ConfigError, match=f"^OUT_DIR {blocker}/x: {blocker} is a file, not a directory; choose another OUT_DIR$"
    ):
        output_dir(blocker, "OUT_DIR", shown=blocker / "x")
    with pytest.raises(ConfigError, match=f"cannot be written: {blocker} is a file, not a directory"):
        output_dir(blocker / "x" / "y", "--out")


def test_only_refusals_of_the_users_paths_are_taken(tmp_path):
    mine = PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "x"))
    assert refusal(mine) is mine and describe(mine).startswith(f"{tmp_path / 'x'}: permission denied; ")
    wrapped = RuntimeError("writer stopped")
    wrapped.__cause__ = mine
    assert refusal(wrapped) is mine
    assert refusal(FileNotFoundError(errno.ENOENT, "gone", str(tmp_path / "x"))) is None
    assert refusal(OSError(errno.ENOSPC, "No space left on device")) is None  # no path to name
    assert refusal(PermissionError(errno.EACCES, "denied", os.__file__)) is None  # Python's own
    assert refusal(PermissionError(errno.EACCES, "denied", str(Path(__file__).parents[2] / "store" / "x.py"))) is None
