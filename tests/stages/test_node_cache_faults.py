"""The node-local cache (--cache-dir) when its disk is full, in real processes as a user runs them:
the run reads on from the object store without the cache and says so once, in one line; and no
cache directory is made by a run that never fetches an object-store file (a local store, a run that
fails first). The object store is fsspec's memory file system and the full disk a wrapper's
(tests/remote_store.py)."""

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.processes import TINY, losses

REMOTE = "memory://remote/hs.zarr"
SAID = "warning: --cache-dir {} cannot be written ({}): reading on from the object store without the node cache"


def remote(program: str, store, full: str, args: list) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "tests.remote_store", program, str(store), full, *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def script(program: str, args: list) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, program, *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def warnings_of(stderr: str) -> list[str]:
    """The cache's warning lines (the progress bar may stand before one: it redraws without a newline)."""
    return re.findall(r"warning: --cache-dir [^\r\n]*", stderr)


TRAIN = ["--store", REMOTE, "--shards", "0-2", "--max-steps", 4, "--threads", 1, *TINY]


def test_a_full_cache_disk_is_said_once_and_the_run_reads_on_without_it(small_store, tmp_path):
    """Full from the start (the index cannot be made: `database or disk is full`), and full after two
    files (a cached file's write fails, or the index's: `disk I/O error`, in a loader worker at step
    1): each run ends as it would without the cache, one warning line naming the directory, no
    traceback; then evaluate.py on a full cache disk the same."""
    runs = {}
    for full, reasons in (
        ("start", ["database or disk is full"]),
        ("after:2", ["No space left on device", "disk I/O error"]),
    ):
        cache, out = tmp_path / f"cache-{full[:5]}", tmp_path / f"run-{full[:5]}"
        r = remote("train", small_store, full, [*TRAIN, "--out", out, "--cache-dir", cache, "--cache-size", "1G"])
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
        said = warnings_of(r.stderr)
        assert len(said) == 1 and any(said[0].startswith(SAID.format(cache, why)) for why in reasons), said
        assert r.stdout.startswith("done: 4 steps") and (out / "final" / "model.safetensors").exists()
        runs[full] = losses(out)
    assert runs["start"] == runs["after:2"]  # the same data read, with or without the copies kept
    cache = tmp_path / "cache-eval"
    r = remote(
        "evaluate",
        small_store,
        "start",
        [
            "--store",
            REMOTE,
            "--checkpoint",
            tmp_path / "run-start" / "final",
            "--out",
            tmp_path / "report",
            "--max-prompts",
            2,
            "--cache-dir",
            cache,
            "--cache-size",
            "1G",
            "--threads",
            1,
        ],
    )
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    said = warnings_of(r.stderr)
    assert len(said) == 1 and said[0].startswith(SAID.format(cache, "database or disk is full")), said
    assert (tmp_path / "report" / "report.json").exists()


@pytest.mark.parametrize("program", ["train", "evaluate"])
def test_no_cache_directory_is_made_by_a_local_store_or_a_failed_run(program, small_store, tmp_path):
    """A local store ignores --cache-dir (a warning says so) and makes nothing there, whether the run
    trains to its end or fails; a run on an object store that fails before it reads a shard (a missing
    checkpoint, held-out shards the store lacks) leaves no cache directory either."""
    cache = tmp_path / "cache"
    flags = ["--cache-dir", cache, "--cache-size", "1G", "--threads", 1]
    if program == "train":
        r = script(
            "train.py",
            ["--store", small_store, "--out", tmp_path / "run", "--shards", "0-2", "--max-steps", 2, *TINY, *flags],
        )
        failed = remote(
            "train", small_store, "after:1000", [*TRAIN, "--out", tmp_path / "run2", "--eval-shards", "60-63", *flags]
        )
    else:
        r = script(
            "evaluate.py",
            ["--store", small_store, "--checkpoint", tmp_path / "run", "--out", tmp_path / "report", *flags],
        )
        failed = remote(
            "evaluate",
            small_store,
            "after:1000",
            ["--store", REMOTE, "--checkpoint", tmp_path / "nope", "--out", tmp_path / "report2", *flags],
        )
    if program == "train":
        assert (
            r.returncode == 0
            and f"warning: --cache-dir {cache} is not used: --store {small_store} is on a local file system already"
            in r.stderr.replace("\r", "\n").splitlines()
        )
    else:  # the checkpoint is missing: the run fails before its warnings
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: ")
    assert failed.returncode == 2 and failed.stderr.splitlines()[-1].startswith("error: ")
    assert not cache.exists()
