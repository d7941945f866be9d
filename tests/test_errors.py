"""A path the file system refuses, in every command: one `error:` line naming the path and the way on
(exit code 2, no traceback), before any work; and mistakes answered before torch is imported."""

import errno
import os
import resource
import subprocess
import sys

import click
import pytest

from stages.command import run_command
from store.errors import ConfigError
from tests.conftest import REPO, SMALL
from tests.drafters import write_released
from tests.processes import cli_args

ROOT = os.geteuid() == 0  # permissions do not stop root


def command(*args, limit_file_bytes: int | None = None) -> subprocess.CompletedProcess:
    """A command as a user runs it: `python train.py ...`, `python evaluate.py ...`, `python -m pipeline ...`."""

    def limit():
        if limit_file_bytes is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_bytes, limit_file_bytes))

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit,
    )


def the_error(p: subprocess.CompletedProcess) -> str:
    """The one `error:` line of a failed command (exit code 2, no traceback)."""
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, p.stderr
    return lines[0]


@pytest.fixture(scope="module")
def released(small_store, tmp_path_factory):
    """A drafter that fits the small store, written the way released ones are."""
    from store.hidden_store import HiddenStore

    attrs = HiddenStore(str(small_store)).attrs
    path = tmp_path_factory.mktemp("drafter") / "released"
    write_released(path, attrs.hidden_size, attrs.vocab_size, list(attrs.taps), attrs.mask_token_id)
    return path


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("not a store\n")
    return path


STORE_USERS = {
    "info": lambda store, tmp, ck: ["-m", "pipeline", "info", store],
    "verify": lambda store, tmp, ck: ["-m", "pipeline", "verify", store],
    "extract": lambda store, tmp, ck: ["-m", "pipeline", "extract", "--store", store, "--device", "cpu"],
    "train": lambda store, tmp, ck: ["train.py", "--store", store, "--out", tmp / "run"],
    "evaluate": lambda store, tmp, ck: ["evaluate.py", "--store", store, "--checkpoint", ck, "--out", tmp / "report"],
    "export": lambda store, tmp, ck: ["-m", "pipeline", "export", ck, tmp / "export", "--store", store],
}


@pytest.mark.parametrize("cmd", [c for c in STORE_USERS if c != "export"])
def test_a_store_path_that_is_a_file_is_refused_in_one_line(cmd, a_file, tmp_path, released):
    line = the_error(command(*STORE_USERS[cmd](a_file, tmp_path, released)))
    assert line == (
        f"error: {a_file}: a file, not a hidden-state store (a store is a directory, as `pipeline "
        "extract` writes it); give the store's directory"
    )
    assert not (tmp_path / "run").exists() and not (tmp_path / "report").exists()


@pytest.mark.parametrize("cmd", ["info", "train", "extract"])
def test_a_store_path_under_a_file_is_refused_naming_the_file(cmd, a_file, tmp_path, released):
    store = a_file / "hs.zarr"
    line = the_error(command(*STORE_USERS[cmd](store, tmp_path, released)))
    assert line.startswith(f"error: {store}: not a hidden-state store: {a_file} is a file (a store is a directory")


def test_export_names_a_store_that_is_a_file_and_goes_on(a_file, tmp_path, released):
    """export's --store is optional: one that cannot be opened is a warning, and the card says so."""
    p = command(*STORE_USERS["export"](a_file, tmp_path, released))
    assert p.returncode == 0, p.stderr
    assert f"store {a_file} cannot be opened: {a_file}: a file, not a hidden-state store" in p.stderr


OUT_USERS = {
    "train": lambda store, out, ck: ["train.py", "--store", store, "--out", out, "--max-steps", 1],
    "evaluate": lambda store, out, ck: ["evaluate.py", "--store", store, "--checkpoint", ck, "--out", out],
    "export": lambda store, out, ck: ["-m", "pipeline", "export", ck, out],
}
FLAG = {"train": "--out", "evaluate": "--out", "export": "OUT_DIR"}


@pytest.mark.parametrize("cmd", OUT_USERS)
def test_an_out_under_a_file_is_refused_before_the_work(cmd, a_file, small_store, released):
    out = a_file / "sub"
    p = command(*OUT_USERS[cmd](small_store, out, released))
    line = the_error(p)
    assert line.startswith(f"error: {FLAG[cmd]} {out}: ") and f"{a_file} is a file, not a directory" in line
    assert "replaying" not in p.stderr and "drafter:" not in p.stderr  # nothing ran


@pytest.mark.parametrize("cmd", ["train", "evaluate"])
def test_an_out_that_is_a_file_is_refused_before_the_work(cmd, a_file, small_store, released):
    line = the_error(command(*OUT_USERS[cmd](small_store, a_file, released)))
    assert line == f"error: --out {a_file}: is a file, not a directory; choose another --out"


@pytest.mark.skipif(ROOT, reason="permissions do not stop root (tests/stages/test_paths.py covers the refusal)")
@pytest.mark.parametrize("cmd", OUT_USERS)
def test_an_out_in_a_read_only_directory_is_refused_before_the_work(cmd, tmp_path, small_store, released):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        p = command(*OUT_USERS[cmd](small_store, locked / "out", released))
    finally:
        locked.chmod(0o755)
    line = the_error(p)
    assert line.startswith(f"error: {FLAG[cmd]} {locked / 'out'}: cannot be written: ") and "permission denied" in line


def test_evaluate_checks_out_before_it_replays(small_store, released, a_file):
    """From Python too: the run refuses --out before a single prompt is replayed."""
    from stages.evaluate.config import EvalConfig
    from stages.evaluate.run import run
    from store.errors import ConfigError

    said = []
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        run(
            EvalConfig(store=str(small_store), checkpoints=(str(released),), out=str(a_file / "report"), device="cpu"),
            log=said.append,
        )
    assert not any("replaying" in line for line in said)


def test_a_file_size_limit_during_extraction_is_one_line_and_a_rerun_completes(tmp_path, small_dataset):
    """The embedding file passes a 256 KiB file-size limit (`ulimit -f`): EFBIG, one line, the root
    uncommitted; the same command without the limit then makes the store."""
    store = tmp_path / "hs.zarr"
    args = ["-m", "pipeline", *cli_args(store, small_dataset, "0-1", **SMALL)]
    line = the_error(command(*args, limit_file_bytes=256 * 1024))
    assert line.startswith(f"error: {store}: file too large; the shards still to write need about ")
    assert line.endswith("raise the file-size limit (`ulimit -f`) and rerun the same command to complete the store")
    assert not (store / "_commits/root.json").exists()
    p = command(*args)
    assert p.returncode == 0, p.stderr
    assert (store / "_commits/00000.json").exists() and (store / "_commits/00001.json").exists()


def _raising(exc):
    @click.command()
    def cmd():
        raise exc

    return cmd


def _run(monkeypatch, capsys, cmd) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["cmd"])
    with pytest.raises(SystemExit) as stop:
        run_command(cmd)
    return stop.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    "code,said",
    [
        (errno.EACCES, "permission denied; choose a path you may write, or change its permissions"),
        (errno.EROFS, "read-only file system; choose a path on a writable file system"),
        (errno.ENOSPC, "no space left on device; free space, or choose a path on another file system"),
        (errno.EDQUOT, "disk quota exceeded; free space within your quota, or choose another file system"),
        (errno.EFBIG, "file too large; raise the file-size limit (`ulimit -f`)"),
        (errno.EISDIR, "is a directory; give a file's path, not a directory's"),
    ],
)
def test_the_file_systems_refusal_of_a_path_is_one_line(monkeypatch, capsys, tmp_path, code, said):
    path = tmp_path / "out" / "report.json"
    for exc in (
        OSError(code, os.strerror(code), str(path)),
        RuntimeError("the writer thread stopped"),
    ):  # raised from the refusal, as a writer thread does
        if isinstance(exc, RuntimeError):
            exc.__cause__ = OSError(code, os.strerror(code), str(path))
        status, err = _run(monkeypatch, capsys, _raising(exc))
        assert status == 2 and len(err.splitlines()) == 1 and err.startswith(f"error: {path}: {said}")


def test_a_path_under_a_file_names_the_file(monkeypatch, capsys, a_file):
    status, err = _run(
        monkeypatch,
        capsys,
        _raising(NotADirectoryError(errno.ENOTDIR, "Not a directory", str(a_file / "x" / "y.json"))),
    )
    assert status == 2
    assert err == f"error: {a_file} is a file, not a directory; choose another path, or move the file out of the way\n"


@pytest.mark.parametrize(
    "exc",
    [
        OSError(errno.EACCES, "Permission denied"),  # no path: nothing to name
        FileNotFoundError(errno.ENOENT, "No such file or directory", "/tmp/x"),  # the code's own expectation
        PermissionError(errno.EACCES, "Permission denied", str(REPO / "stages" / "command.py")),  # the installation's
        KeyError("a bug"),
    ],
)
def test_internal_errors_keep_their_traceback(monkeypatch, capsys, exc):
    monkeypatch.setattr(sys, "argv", ["cmd"])
    with pytest.raises(type(exc)):
        run_command(_raising(exc))


MISTAKES = {
    "a bad flag value": (["train.py", "--epochs", "0"], "error: --epochs 0: must be at least 1"),
    "a store that is a file": (["train.py", "--store", "{file}"], "error: {file}: a file, not a hidden-state store"),
    "a missing store": (
        ["evaluate.py", "--checkpoint", "ck", "--store", "{tmp}/none.zarr"],
        "error: {tmp}/none.zarr: not a hidden-state store (no _commits/root.json)",
    ),
    "an out under a file": (
        ["evaluate.py", "--checkpoint", "ck", "--store", "{store}", "--out", "{file}/r"],
        "error: --out {file}/r: cannot be written: {file} is a file",
    ),
    "an extract flag": (
        ["pipeline", "extract", "--compression-level", "99"],
        "error: --compression-level 99: levels run -7 to 22",
    ),
    "info on a file": (["pipeline", "info", "{file}"], "error: {file}: a file, not a hidden-state store"),
    "a plan flag": (
        ["pipeline", "plan", "--decode-tokens-s", "5000-100"],
        "error: --decode-tokens-s 5000-100: expected LOW-HIGH",
    ),
}
PROBE = """import runpy, sys
sys.argv = sys.argv[1:]
try:
    if sys.argv[0].endswith(".py"):
        runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
finally:
    print("torch imported" if "torch" in sys.modules else "torch not imported", file=sys.stderr)
"""


@pytest.mark.parametrize("mistake", MISTAKES)
def test_mistakes_are_answered_before_torch_is_imported(mistake, a_file, tmp_path, small_store):
    """The command exactly as run (`python train.py ...`, `python -m pipeline ...`), asked at its end
    whether torch was imported."""
    args, expect = MISTAKES[mistake]
    fill = {"file": a_file, "tmp": tmp_path, "store": small_store}
    p = command("-c", PROBE, *(a.format(**fill) for a in args))
    assert the_error(p).startswith(expect.format(**fill))
    assert p.stderr.splitlines()[-1] == "torch not imported"


@pytest.mark.parametrize("entry", ["train.py", "evaluate.py"])
def test_the_early_out_check_makes_nothing_a_failed_run_would_leave(entry, small_store, tmp_path):
    """The entry point checks --out before torch is imported without making it: a run that then fails
    (the README's second command after its 8-shard set-up: held-out shards the store lacks; a drafter
    that is not there) leaves no empty runs/a, nor runs/."""
    out = tmp_path / "runs" / "a"
    extra = ["--eval-shards", "60-63"] if entry == "train.py" else ["--checkpoint", tmp_path / "no-drafter"]
    line = the_error(command(entry, "--store", small_store, "--out", out, *extra))
    assert ("60-63" if entry == "train.py" else "no-drafter") in line
    assert not (tmp_path / "runs").exists()


def test_the_early_out_check_refuses_what_cannot_be_made(a_file, tmp_path):
    from stages.paths import writable_dir

    with pytest.raises(ConfigError, match="cannot be written: .*notes.txt is a file, not a directory"):
        writable_dir(a_file / "runs" / "a", "--out")
    writable_dir(tmp_path / "new" / "deeper", "--out")
    assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == [a_file]
