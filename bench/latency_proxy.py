"""A small HTTP proxy in front of an S3 endpoint (moto's server) that adds a fixed delay to every
request and counts requests and response bytes: an object store's per-request latency on
127.0.0.1, for bench/s3_bench.py.

    python -m bench.latency_proxy --upstream http://127.0.0.1:5000 --delay-ms 50 [--port 0]

prints `listening on http://127.0.0.1:PORT` and serves until killed; clients point their S3
endpoint (FSSPEC_S3_ENDPOINT_URL) at it. In a Python process, `LatencyProxy(upstream, delay_s).start()`
serves from a thread and keeps the counts (`requests`, `bytes`, by method in `by_method`; GET
/__counts__ answers them as JSON). Each
request waits its delay in its own thread, so requests in flight together overlap their waits as
they do against a real store; bandwidth is not limited.
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
import time
import urllib.parse
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


class LatencyProxy:
    def __init__(self, upstream: str, delay_s: float, port: int = 0) -> None:
        self.upstream = urllib.parse.urlsplit(upstream)
        self.delay_s = delay_s
        self.requests = 0
        self.bytes = 0  # response bodies
        self.by_method: Counter = Counter()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> LatencyProxy:
        threading.Thread(target=self._server.serve_forever, name="latency-proxy", daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def counts(self) -> tuple[int, int]:
        """(requests, response bytes) so far."""
        with self._lock:
            return self.requests, self.bytes

    def _count(self, method: str, nbytes: int) -> None:
        with self._lock:
            self.requests += 1
            self.bytes += nbytes
            self.by_method[method] += 1


def _handler(proxy: LatencyProxy):
    local = threading.local()  # one upstream connection per handler thread, kept alive

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients use it

        def log_message(self, *args) -> None:
            pass

        def _forward(self) -> None:
            if self.path == "/__counts__":  # the counts so far, as JSON (not forwarded, not counted)
                data = json.dumps({"requests": proxy.requests, "bytes": proxy.bytes}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            time.sleep(proxy.delay_s)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            for attempt in range(2):
                conn = getattr(local, "conn", None)
                if conn is None:
                    conn = local.conn = http.client.HTTPConnection(
                        proxy.upstream.hostname, proxy.upstream.port, timeout=600
                    )
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    break
                except (http.client.HTTPException, OSError):
                    conn.close()
                    local.conn = None
                    if attempt:
                        raise
            self.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP and (k.lower() != "content-length" or self.command == "HEAD"):
                    self.send_header(k, v)  # a HEAD's length is the object's: what s3fs takes as its size
            if self.command != "HEAD":
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            proxy._count(self.command, len(data) if self.command != "HEAD" else 0)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    return Handler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--upstream", required=True, help="the S3 endpoint to forward to, e.g. http://127.0.0.1:5000")
    p.add_argument("--delay-ms", type=float, default=50.0)
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    proxy = LatencyProxy(args.upstream, args.delay_ms / 1000, args.port)
    print(f"listening on {proxy.url}", flush=True)
    try:
        proxy._server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
