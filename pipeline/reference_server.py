"""A running OpenAI-compatible engine (vLLM, SGLang) as the source of greedy references.

Prompts go out as the token ids the store records (the chat template is rendered here, never by
the server) and completions come back as the engine's token ids: text never round-trips, since
that changes ids. Requests are greedy (temperature 0), or sampled (`Sampling`: temperature, top-p,
top-k, and a seed per request, the row's: pipeline/sampling.py), limited to `max_tokens` and stopped
at the target's EOS ids; many are in flight at once (the engine batches them) while the caller captures
earlier ones. Transient failures (connection errors, timeouts, HTTP 429 and 5xx) are retried
with backoff; a prompt the server rejects (HTTP 400: too long, ...) comes back as None, to be
skipped and counted.

Which engine runs is read from the server itself (`owned_by` of /v1/models). vLLM (0.32, measured
here against the real server): `/v1/completions` with `"prompt": [ids]` and
`"return_token_ids": true` answers in `choices[0].token_ids`, the stop token included; its version
is `/version`. SGLang (read from its code, 0.5.x): the native `/generate` takes `input_ids` and
`sampling_params` and answers in `output_ids`, with the stop that matched in
`meta_info.finish_reason.matched`; its version is in `/server_info` (older: `/get_server_info`).
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from pipeline.errors import EngineError
from pipeline.sampling import row_seed
from store.format.schema import Sampling

TRANSIENT = {408, 429, 500, 502, 503, 504}
PROBE = "def probe(x):\n    return [x, 'probe']  # vocabulary check"


@dataclass(frozen=True)
class ServerInfo:
    """What the store records about the references' source."""

    url: str  # without credentials
    model: str
    engine: str  # "vllm", "sglang" or "openai-compatible"
    version: str | None

    @property
    def identity(self) -> str:
        """What a rerun must match: engine, version and model (not the URL, which may move)."""
        return f"{self.engine} {self.version or '?'} {self.model}"


def redact(url: str) -> str:
    """The URL without user, password or query string."""
    p = urllib.parse.urlsplit(url)
    host = p.hostname or ""
    return urllib.parse.urlunsplit((p.scheme, host + (f":{p.port}" if p.port else ""), p.path.rstrip("/"), "", ""))


def server_root(url: str) -> str:
    """The server's root: the URL redacted, less the OpenAI clients' `/v1` base path if given."""
    root = redact(url)
    return root[: -len("/v1")] if root.endswith("/v1") else root


class ReferenceServer:
    def __init__(
        self,
        url: str,
        model: str | None = None,
        concurrency: int = 32,
        timeout_s: float = 600.0,
        retries: int = 4,
        backoff_s: float = 1.0,
        sampling: Sampling | None = None,
    ) -> None:
        """sampling: the references sampled so (None: greedy), each request with its row's seed."""
        self.url, self.model = server_root(url), model  # http://host:port and http://host:port/v1 alike
        self.sampling = sampling
        self.headers = {"Content-Type": "application/json", **_auth(url)}
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.info: ServerInfo | None = None
        self.concurrency = concurrency
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="engine")
        self._timing = threading.Lock()
        self.requests, self.request_s = 0, 0.0  # completions answered, and their summed latency

    # -- setup -----------------------------------------------------------------------------
    def connect(self) -> ServerInfo:
        """Find the served model (the one asked for, or the only one) and which engine serves it."""
        served = self._get("/v1/models").get("data", [])
        models = [m["id"] for m in served]
        if self.model is None:
            if len(models) != 1:
                raise EngineError(
                    f"--server-url {redact(self.url)} serves {models or 'no model'}; choose one with --server-model"
                )
            self.model = models[0]
        elif self.model not in models:
            raise EngineError(f"--server-model {self.model}: {redact(self.url)} serves {models}, not it")
        owner = next((m.get("owned_by") for m in served if m["id"] == self.model), None)
        engine = owner if owner in ("vllm", "sglang") else "openai-compatible"
        self.info = ServerInfo(redact(self.url), self.model, engine, self._version(engine))
        return self.info

    def _version(self, engine: str) -> str | None:
        paths = {"vllm": ("/version",), "sglang": ("/server_info", "/get_server_info")}.get(engine, ("/version",))
        for path in paths:
            try:
                return self._get(path, retries=0).get("version")
            except EngineError:
                continue
        return None

    def check_vocabulary(self, tokenizer) -> None:
        """The server must tokenize a probe text to the ids our tokenizer gives (same vocabulary)."""
        ours = tokenizer(PROBE, add_special_tokens=False).input_ids
        body = {"model": self.model, "prompt": PROBE, "add_special_tokens": False}
        try:
            theirs = self._post("/tokenize", body, retries=0).get("tokens")
        except EngineError:
            return  # the engine has no /tokenize: nothing to compare; the agreement check remains
        if theirs != ours:
            raise EngineError(
                f"--server-url {redact(self.url)}: the served model {self.model} has another vocabulary "
                f"(it tokenizes a probe text to {theirs[:8]}..., the target's tokenizer to {ours[:8]}...)"
            )

    # -- completions -----------------------------------------------------------------------
    def submit(self, prompt: list[int], max_tokens: int, stop_ids: list[int], row: int = 0) -> Future:
        """A future of the completion's token ids (EOS kept), or None when the server rejects it. row: the
        prompt's dataset row, whose seed a sampled request carries (pipeline/sampling.py)."""
        return self._pool.submit(self.complete, prompt, max_tokens, stop_ids, row)

    def complete(self, prompt: list[int], max_tokens: int, stop_ids: list[int], row: int = 0) -> list[int] | None:
        if max_tokens <= 0:
            return []
        t0 = time.perf_counter()
        try:
            return self._complete(prompt, max_tokens, stop_ids, row)
        finally:
            with self._timing:
                self.requests += 1
                self.request_s += time.perf_counter() - t0

    def _sampling_params(self, row: int, seed_key: str) -> dict:
        """The request's sampling settings: temperature 0 (greedy), or the temperature, the cuts made
        and the row's seed under the engine's name for it (vLLM `seed`, SGLang `sampling_seed`)."""
        s = self.sampling
        if s is None:
            return {"temperature": 0}
        cuts = {k: v for k, v in (("top_p", s.top_p), ("top_k", s.top_k)) if v is not None}
        return {"temperature": s.temperature, **cuts, seed_key: row_seed(s.seed, row)}

    def _complete(self, prompt: list[int], max_tokens: int, stop_ids: list[int], row: int) -> list[int] | None:
        if self.info is not None and self.info.engine == "sglang":
            body = {
                "input_ids": prompt,
                "sampling_params": {
                    **self._sampling_params(row, "sampling_seed"),
                    "max_new_tokens": max_tokens,
                    "stop_token_ids": stop_ids,
                },
            }
            out = self._post("/generate", body, rejected_ok=True)
            if out is None:
                return None
            finish = out.get("meta_info", {}).get("finish_reason") or {}
            return _with_eos(
                out["output_ids"],
                {"matched_stop": finish.get("matched") if isinstance(finish, dict) else None},
                stop_ids,
            )
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            **self._sampling_params(row, "seed"),
            "stop_token_ids": stop_ids,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        out = self._post("/v1/completions", body, rejected_ok=True)
        if out is None:
            return None
        choice = out["choices"][0]
        if choice.get("token_ids") is None:
            raise EngineError(
                f"--server-url {redact(self.url)}: the completion carries no token ids "
                "(the server ignored return_token_ids; a vLLM too old?)"
            )
        return _with_eos(
            choice["token_ids"],
            {"finish_reason": choice.get("finish_reason"), "matched_stop": choice.get("stop_reason")},
            stop_ids,
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- HTTP ------------------------------------------------------------------------------
    def _get(self, path: str, retries: int | None = None) -> dict:
        return self._request(urllib.request.Request(self.url + path, headers=self.headers), retries)

    def _post(self, path: str, body: dict, retries: int | None = None, rejected_ok: bool = False) -> dict | None:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), method="POST", headers=self.headers
        )
        return self._request(req, retries, rejected_ok)

    def _request(self, req, retries: int | None, rejected_ok: bool = False) -> dict | None:
        tries = 1 + (self.retries if retries is None else retries)
        last = ""
        for attempt in range(tries):
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as e:
                if e.code in (400, 413, 422) and rejected_ok:
                    return None
                last = f"HTTP {e.code} {e.reason}"
                if e.code not in TRANSIENT:
                    break
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            if attempt + 1 < tries:
                time.sleep(self.backoff_s * 2**attempt)
        raise EngineError(
            f"--server-url {redact(self.url)}: {req.full_url.removeprefix(self.url)} failed "
            f"after {tries} tr{'y' if tries == 1 else 'ies'} ({last})"
        )


def _auth(url: str) -> dict:
    """Credentials for the server: user:password in the URL (HTTP basic), else $OPENAI_API_KEY as a
    bearer token (what `vllm serve --api-key` and SGLang's --api-key check)."""
    p = urllib.parse.urlsplit(url)
    if p.username or p.password:
        token = base64.b64encode(
            f"{urllib.parse.unquote(p.username or '')}:{urllib.parse.unquote(p.password or '')}".encode()
        ).decode()
        return {"Authorization": f"Basic {token}"}
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _with_eos(ids: list[int], meta: dict, stop_ids: list[int]) -> list[int]:
    """The completion as generate() gives it: ending with the EOS that stopped it. An engine that
    leaves the stop token out names it (vLLM: stop_reason, SGLang: matched_stop) or, for the model's
    own EOS, says finish_reason "stop"."""
    ids = list(ids)
    matched = meta.get("matched_stop")
    if isinstance(matched, int) and (not ids or ids[-1] != matched):
        ids.append(matched)
    elif meta.get("finish_reason") == "stop" and stop_ids and (not ids or ids[-1] not in stop_ids):
        ids.append(stop_ids[0])
    return ids
