"""Fingerprints: stable hashes, and a file hashed once however many processes ask at the same time."""

import os
import subprocess
import sys
import time

from pipeline import fingerprint
from tests.conftest import REPO

CHILD = """
import os, sys, time
from pipeline import fingerprint
real = fingerprint.hash_file
def counted(path):
    with open(sys.argv[2], "a") as fh:
        fh.write("x")
    return real(path)
fingerprint.hash_file = counted
open(sys.argv[3] + f".{os.getpid()}", "w").close()  # ready
while not os.path.exists(sys.argv[3]):  # all start hashing together
    time.sleep(0.001)
print(fingerprint.sha256_file(sys.argv[1]))
"""


def test_json_hash_ignores_key_order():
    assert fingerprint.sha256_json({"a": 1, "b": [1, 2]}) == fingerprint.sha256_json({"b": [1, 2], "a": 1})
    assert fingerprint.sha256_json({"a": 1}) != fingerprint.sha256_json({"a": 2})


def test_four_processes_hash_a_file_once(tmp_path):
    big = tmp_path / "weights.bin"
    big.write_bytes(os.urandom(1 << 20) * 48)  # 48 MiB: long enough for the processes to overlap
    counter = tmp_path / "hashed"
    env = {**os.environ, "DFLASH_CACHE": str(tmp_path / "cache")}
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(big), str(counter), str(go)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    deadline = time.time() + 60
    while len(list(tmp_path.glob("go.*"))) < 4 and time.time() < deadline:
        time.sleep(0.01)
    go.touch()
    digests = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert digests == {fingerprint.hash_file(big)}
    assert counter.read_text() == "x"  # one of the four hashed it; the others read its result


def test_a_changed_file_is_hashed_again(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 100)
    first = fingerprint.sha256_file(f)
    f.write_bytes(b"b" * 101)
    second = fingerprint.sha256_file(f)
    assert second != first and second == fingerprint.hash_file(f)
