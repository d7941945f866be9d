"""A real S3 API server for the opt-in object-store tests: moto's server in its own venv (built
once by tools/s3/build_moto.sh: $DFLASH_S3_VENV, default ~/.cache/dflash-pipeline/moto-venv),
started on 127.0.0.1 and stopped by the fixture that started it. Clients reach it as they reach
any S3 endpoint: s3fs with FSSPEC_S3_ENDPOINT_URL and (dummy) credentials in the environment."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import urllib.request
from pathlib import Path

from tests.conftest import REPO, SMALL
from tests.engines import free_port

VENV = Path(os.environ.get("DFLASH_S3_VENV", Path.home() / ".cache" / "dflash-pipeline" / "moto-venv"))
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class S3Server:
    def __init__(self, log: Path) -> None:
        self.log, self.port = log, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        """What a client process needs in its environment to use this server as S3."""
        return {**CREDENTIALS, "FSSPEC_S3_ENDPOINT_URL": self.url}

    def start(self, timeout_s: float = 60) -> S3Server:
        subprocess.run(["bash", str(REPO / "tools" / "s3" / "build_moto.sh"), str(VENV)], check=True)
        self.proc = subprocess.Popen(
            [str(VENV / "bin" / "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                urllib.request.urlopen(self.url, timeout=2).read()
                return self
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"moto_server exited ({self.proc.returncode}); see {self.log}") from None
                time.sleep(0.5)
        raise TimeoutError(f"moto_server not ready after {timeout_s}s; see {self.log}")

    def requests(self) -> int:
        """Requests the server has answered so far (its access log lines)."""
        return sum(" HTTP/1.1" in line for line in self.log.read_text(errors="replace").splitlines())

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def extract_args(store: str, dataset, shards: str, *extra: str) -> list[str]:
    args = ["extract", "--store", store, "--dataset", str(dataset), "--shards", shards, "--num-shards", "4"]
    return args + [x for k, v in SMALL.items() for x in (f"--{k.replace('_', '-')}", str(v))] + list(extra)


@contextlib.contextmanager
def serving(log: Path, bucket: str):
    """A server for this process and the ones it starts (a bench's): the environment and fsspec's
    configuration point at it and `bucket` exists; stopped on leaving."""
    server = S3Server(log).start()
    os.environ.update(server.env)
    import fsspec.config

    fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = server.url
    try:
        fsspec.filesystem("s3").mkdir(bucket)
        yield server
    finally:
        server.stop()
