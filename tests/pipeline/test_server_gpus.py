"""A reference server on this host that holds the target's GPU is refused in one line: a real
listening process (and its child, as an engine's workers are) against a stand-in nvidia-smi."""

import os
import subprocess
import sys
import textwrap

import pytest

from pipeline import server_gpus
from store.errors import ConfigError

# Listens on 127.0.0.1 (a free port, printed), starts a child that sleeps (an engine's worker), prints its pid.
SERVER = textwrap.dedent(
    """
    import socket, subprocess, sys, time
    s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print(s.getsockname()[1], child.pid, flush=True)
    time.sleep(120)
    """
)


@pytest.fixture
def server():
    """(port, listener pid, worker pid) of a live local server."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    port, worker = map(int, proc.stdout.readline().split())
    yield port, proc.pid, worker
    import psutil

    for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
        p.kill()
    proc.wait()


@pytest.fixture
def smi(tmp_path, monkeypatch):
    """A stand-in nvidia-smi on PATH that lists the compute processes written to it."""

    def listing(rows: list[tuple[str, int]]) -> None:
        out = "".join(f"{uuid}, {pid}\n" for uuid, pid in rows)
        script = tmp_path / "nvidia-smi"
        script.write_text(f"#!/bin/sh\nprintf '{out}'\n")
        script.chmod(0o755)

    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return listing


@pytest.mark.parametrize("holder", ["listener", "worker"])
def test_a_local_engine_on_the_targets_gpu_is_one_line(server, smi, holder):
    port, listener, worker = server
    pid = listener if holder == "listener" else worker
    smi([("GPU-aaaa", pid), ("GPU-bbbb", 1)])
    with pytest.raises(ConfigError) as e:
        server_gpus.check(f"http://127.0.0.1:{port}", "aaaa", "GPU 0 (H100)")
    text = str(e.value)
    assert f"by process(es) {pid}, which hold GPU 0 (H100)" in text  # the one holding our GPU, no other
    assert "CUDA_VISIBLE_DEVICES" in text and "\n" not in text


def test_an_engine_on_other_gpus_or_hosts_passes(server, smi):
    port, listener, worker = server
    smi([("GPU-bbbb", listener), ("GPU-bbbb", worker), ("GPU-aaaa", 1)])  # ours holds another process
    server_gpus.check(f"http://localhost:{port}", "GPU-aaaa", "GPU 0")
    smi([("GPU-aaaa", listener)])
    server_gpus.check(f"http://127.0.0.1:{port + 1 if port < 65535 else port - 1}", "GPU-aaaa", "GPU 0")
    server_gpus.check(f"http://192.0.2.1:{port}", "GPU-aaaa", "GPU 0")  # another host (TEST-NET-1)


def test_no_nvidia_smi_passes(server, monkeypatch, tmp_path):
    port, _, _ = server
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    assert server_gpus.gpu_processes() == {}
    server_gpus.check(f"http://127.0.0.1:{port}", "GPU-aaaa", "GPU 0")


def test_local_ports():
    assert server_gpus.local_port("http://127.0.0.1:8000/v1") == 8000
    assert server_gpus.local_port("http://localhost") == 80
    assert server_gpus.local_port("https://[::1]") == 443
    assert server_gpus.local_port("http://user:pw@0.0.0.0:9000") == 9000
    assert server_gpus.local_port("http://192.0.2.1:8000") is None
    assert server_gpus.local_port("http://refs.example.com:8000") is None
