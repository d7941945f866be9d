"""An OpenAI-compatible server on 127.0.0.1 that answers like vLLM (the facts measured against the
real one: /v1/models, /version, /tokenize, /v1/completions with token-id prompts and
`return_token_ids`), with the tiny target's own greedy completions (sampled ones at a temperature,
with the request's seed). Faults on demand: the first N completion requests fail with 503, prompts
longer than a limit are rejected with 400, the server stops answering after K completions, or it
serves another vocabulary."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from transformers import GenerationConfig, LogitsProcessorList

from pipeline.sampling import RowSampler
from pipeline.target.model import cut
from store.format.schema import Sampling


class FakeEngine:
    def __init__(
        self,
        target,
        model: str = "tiny",
        fail_first: int = 0,
        reject_longer_than: int | None = None,
        die_after: int | None = None,
        vocab_shift: int = 0,
    ) -> None:
        self.target, self.model = target, model
        self.fail_first, self.reject_longer_than, self.die_after = fail_first, reject_longer_than, die_after
        self.vocab_shift = vocab_shift
        self.requests = 0
        self.bodies: list[dict] = []  # every completion request answered
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeEngine:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def completion(self, body: dict) -> dict:
        """The target's greedy completion of the prompt ids, or with a temperature its completion
        sampled with the request's seed as extraction samples a row with it (pipeline/sampling.py); EOS
        kept, finish_reason as vLLM says it. (Plain Hugging Face generate: the target's kernel recorder
        belongs to the extraction.)"""
        t = self.target
        config = GenerationConfig(
            max_new_tokens=body["max_tokens"],
            do_sample=False,
            num_beams=1,
            eos_token_id=t.eos_ids,
            pad_token_id=t.pad_id,
        )
        ids = torch.tensor([body["prompt"]])
        sampled = []
        if body["temperature"] > 0:
            s = Sampling(temperature=body["temperature"], top_p=body.get("top_p"), top_k=body.get("top_k"))
            sampled = [RowSampler(s, [body["seed"]], len(body["prompt"]))]
        with self._lock, torch.inference_mode():
            self.bodies.append(body)
            new = t.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                generation_config=config,
                logits_processor=LogitsProcessorList(sampled),
            )
        out = cut(new[0, len(body["prompt"]) :].tolist(), t.eos_ids, body["max_tokens"])
        stopped = bool(out) and out[-1] in body.get("stop_token_ids", [])
        return {
            "id": "cmpl-fake",
            "object": "text_completion",
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "text": "",
                    "token_ids": out,
                    "finish_reason": "stop" if stopped else "length",
                    "stop_reason": None,
                }
            ],
        }

    def _handler(self):
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(
                        200, {"object": "list", "data": [{"id": engine.model, "object": "model", "owned_by": "vllm"}]}
                    )
                elif self.path == "/version":
                    self._send(200, {"version": "0.0-fake"})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    ids = engine.target.tokenizer(body["prompt"], add_special_tokens=False).input_ids
                    self._send(200, {"tokens": [t + engine.vocab_shift for t in ids], "count": len(ids)})
                    return
                if self.path != "/v1/completions":
                    self._send(404, {"error": "not found"})
                    return
                with engine._lock:
                    engine.requests += 1
                    n = engine.requests
                if engine.die_after is not None and n > engine.die_after:
                    self.close_connection = True
                    self.connection.close()
                    return
                if n <= engine.fail_first:
                    self._send(503, {"error": "busy"})
                elif engine.reject_longer_than is not None and len(body["prompt"]) > engine.reject_longer_than:
                    self._send(400, {"error": "prompt too long"})
                else:
                    self._send(200, engine.completion(body))

        return Handler
