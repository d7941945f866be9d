"""A real vLLM server for the opt-in engine tests: its own venv, built once by
tools/engines/build_vllm_cpu.sh ($DFLASH_ENGINE_VENV, default ~/.cache/dflash-pipeline/vllm-cpu-venv),
started on 127.0.0.1 and stopped by the test that started it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from tests.conftest import REPO

VENV = Path(os.environ.get("DFLASH_ENGINE_VENV", Path.home() / ".cache" / "dflash-pipeline" / "vllm-cpu-venv"))


def build_venv() -> Path:
    subprocess.run(["bash", str(REPO / "tools" / "engines" / "build_vllm_cpu.sh"), str(VENV)], check=True)
    return VENV / "bin" / "python"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on the model directory, bf16 (the CPU Gated
    DeltaNet kernel's only dtype). Ready once a real completion comes back: vLLM answers /health
    before a request can kill its engine (a wrong head dim does)."""

    def __init__(self, model: Path, log: Path, port: int | None = None) -> None:
        self.model, self.log, self.port = model, log, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 600) -> VllmServer:
        python = build_venv()
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2"}
        self.proc = subprocess.Popen(
            [
                str(python),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(self.model),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dtype",
                "bfloat16",
                "--enforce-eager",
                "--gpu-memory-utilization",
                "0.1",
                "--max-model-len",
                "2048",
                "--seed",
                "0",
            ],
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}); see {self.log}")
            try:
                self.complete([1, 2, 3], 2)
                return self
            except OSError:
                time.sleep(2)
        raise TimeoutError(f"vLLM not ready after {timeout_s}s; see {self.log}")

    def complete(self, prompt: list[int], max_tokens: int, stop: list[int] | None = None) -> list[int]:
        body = {
            "model": str(self.model),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stop_token_ids": stop or [],
            "return_token_ids": True,
        }
        req = urllib.request.Request(
            self.url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())["choices"][0]["token_ids"]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
