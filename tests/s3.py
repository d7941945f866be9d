"""A real S3 API server for the opt-in object-store tests: moto's server in its own venv (built
once by tools/s3/build_moto.sh: $DFLASH_S3_VENV, default ~/.cache/dflash-pipeline/moto-venv),
started on 127.0.0.1 and stopped by the fixture that started it. Clients reach it as they reach
any S3 endpoint: s3fs with FSSPEC_S3_ENDPOINT_URL and (dummy) credentials in the environment.

`HeaderStripper` is an S3-compatible store that ignores conditional writes, made from that server:
an HTTP proxy on 127.0.0.1 that drops If-None-Match and If-Match from every request it forwards."""

from __future__ import annotations

import contextlib
import http.client
import os
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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


_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "expect"}


class HeaderStripper:
    """An HTTP proxy on 127.0.0.1 in front of an S3 endpoint that forwards every request without the
    headers named in `strip` (case-insensitive), as a store that accepts and ignores them; `stripped`
    counts the headers it dropped. Standard library only; stopped by `stop` (or on leaving `with`)."""

    def __init__(self, upstream: str, strip: tuple[str, ...] = ("If-None-Match", "If-Match")) -> None:
        self.upstream = urllib.parse.urlsplit(upstream)
        self.strip = {h.lower() for h in strip}
        self.stripped = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _stripping_handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> HeaderStripper:
        threading.Thread(target=self._server.serve_forever, name="header-stripper", daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> HeaderStripper:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _stripping_handler(proxy: HeaderStripper):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients use it (and `Expect: 100-continue` answered)

        def log_message(self, *args) -> None:
            pass

        def _body(self) -> bytes:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                parts = []
                while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return b"".join(parts)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _forward(self) -> None:
            body = self._body()
            headers = {}
            for k, v in self.headers.items():
                if k.lower() in proxy.strip:
                    with proxy._lock:
                        proxy.stripped += 1
                elif k.lower() not in _HOP:
                    headers[k] = v
            if body or self.command in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=120)
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
            finally:
                conn.close()
            self.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP and (k.lower() != "content-length" or self.command == "HEAD"):
                    self.send_header(k, v)  # a HEAD's length is the object's: what s3fs takes as its size
            if self.command != "HEAD":
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    return Handler


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
