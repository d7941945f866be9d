"""Every object-store failure as a user meets it is one `error:` line (exit code 2, no traceback)
naming the store, the endpoint or bucket, and the fix (store/io/object_store.py): s3fs not installed
(here, whatever this environment has); and, with a real S3 API (`pytest -m s3`: moto's server on
127.0.0.1), a bucket that does not exist, no credentials, an endpoint that does not answer. Each
command that opens a store is run: info, verify, extract (before the target loads), train.py,
evaluate.py."""

import os
import socket
import subprocess
import sys

import pytest

from tests.conftest import REPO

STORE = "s3://nobucket/hs.zarr"


def commands(store: str, tmp_path) -> dict[str, list[str]]:
    return {
        "info": ["pipeline", "info", store],
        "verify": ["pipeline", "verify", store],
        "extract": ["pipeline", "extract", "--store", store, "--shards", "0", "--num-shards", "4"],
        "train": ["train", "--store", store, "--out", str(tmp_path / "run")],
        "evaluate": [
            "evaluate",
            "--store",
            store,
            "--checkpoint",
            str(tmp_path / "ck"),
            "--out",
            str(tmp_path / "report"),
        ],
    }


def run(args: list[str], env: dict, wrapper: str | None = None, drop: str | None = None) -> subprocess.CompletedProcess:
    """A command as a user runs it, with env added to this environment (less the variables starting drop)."""
    program = args[0]
    if wrapper:
        cmd = [sys.executable, "-m", wrapper, *args]
    elif program == "pipeline":
        cmd = [sys.executable, "-m", "pipeline", *args[1:]]
    else:
        cmd = [sys.executable, f"{program}.py", *args[1:]]
    base = {k: v for k, v in os.environ.items() if drop is None or not k.startswith(drop)}
    return subprocess.run(
        cmd, cwd=REPO, env={**base, "OMP_NUM_THREADS": "1", **env}, capture_output=True, text=True, timeout=300
    )


def one_line(r: subprocess.CompletedProcess) -> str:
    assert (r.returncode, "Traceback" in r.stderr, r.stderr.count("\n")) == (2, False, 1), r.stderr[-3000:]
    return r.stderr.rstrip("\n")


@pytest.mark.parametrize("name", ["info", "verify", "extract", "train", "evaluate"])
def test_s3fs_not_installed_is_one_line_naming_the_install(name, tmp_path):
    r = run(commands(STORE, tmp_path)[name], {}, wrapper="tests.without_s3fs")
    assert one_line(r) == (
        f"error: {STORE}: fsspec's s3:// file system needs s3fs, which is not installed; pip "
        "install s3fs (in a checkout: pip install -e '.[s3]')"
    )
    assert not (tmp_path / "run").exists() and not (tmp_path / "report").exists()


@pytest.mark.s3
@pytest.mark.parametrize("name", ["info", "verify", "extract", "train", "evaluate"])
def test_a_missing_bucket_or_credentials_is_one_line(name, s3, tmp_path):
    r = run(commands(STORE, tmp_path)[name], {})
    assert one_line(r) == (
        f"error: {STORE}: bucket nobucket does not exist at {s3.url}; check the bucket in the "
        "store's URL, or create the bucket first"
    )
    nowhere = str(tmp_path / "none")  # no key in the environment, no credentials file, no instance metadata
    anonymous = {
        "AWS_SHARED_CREDENTIALS_FILE": nowhere,
        "AWS_CONFIG_FILE": nowhere,
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    r = run(commands("s3://bucket/hs.zarr", tmp_path)[name], anonymous, drop="AWS_")
    assert one_line(r) == (
        f"error: s3://bucket/hs.zarr: no credentials for the object store at {s3.url}; set "
        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment, as "
        "for any S3 client"
    )


@pytest.mark.s3
@pytest.mark.parametrize("name", ["info", "train"])
def test_an_endpoint_that_does_not_answer_is_one_line(name, s3, tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    r = run(commands(STORE, tmp_path)[name], {"FSSPEC_S3_ENDPOINT_URL": closed})
    assert one_line(r).startswith(
        f"error: {STORE}: cannot reach the object store at {closed} (Could not connect "
        f'to the endpoint URL: "{closed}/nobucket"); check that it runs and the endpoint'
    )
