"""`evaluate.py --served vllm`: the store's target served with the drafter by a real engine over the
replayed prompts, and the tau it measured beside replay's.

The prompts go to vLLM as the stored prompt token ids, greedy, with the extraction's completion
limit and the target's EOS ids; vLLM runs in its own Python (`--served-python`), through
vllm_worker.py, and returns each request's tokens and its accepted drafts per verify step.

Two conventions are aligned before comparing (docs/evaluation.md):
- vLLM counts accepted + 1 tokens for every step, the last one too, even past EOS or max_tokens;
  replay cuts the last round to what is left. The served steps are cut the same way here, so served
  tau is (completion tokens - 1) / steps, like replay's (the first token comes from the prefill);
  vLLM's own figure (mean accepted + 1) is reported beside it.
- vLLM's kernels may break near-ties differently from the target that wrote the store, and then
  the completions differ. Served and replay are compared over the prompts whose served completion
  equals the stored one, and over all prompts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from pipeline.decode.acceptance import round_tokens, summarize
from pipeline.drafter.config import read_config
from pipeline.errors import EngineError
from stages.evaluate.engine_device import EngineDevice
from store.format.schema import StoreAttrs

WORKER = Path(__file__).with_name("vllm_worker.py")
Rounds = list[tuple[int, int]]  # (accepted drafts, tokens committed) per round


class ServedBench:
    """The sample's prompts, served once per drafter. texts: per prompt, (its stored tokens: prompt
    then completion, prompt length)."""

    def __init__(self, python: str, target: str, texts: list[tuple[np.ndarray, int]], attrs: StoreAttrs, log) -> None:
        check_python(python)
        self.python, self.target, self.texts, self.attrs, self.log = python, target, texts, attrs, log

    def request(self, drafter: str, block_size: int, where: EngineDevice) -> dict:
        compat = self.attrs.compat
        return {
            "target": self.target,
            "drafter": str(Path(drafter).resolve()),
            "method": read_config(drafter)[0].head,  # dflash, or dspark (vLLM's Qwen3DSparkModel)
            "dtype": "bfloat16",
            "seed": 0,
            "num_speculative_tokens": block_size - 1,
            "max_model_len": compat.max_length,
            "gpu_memory_utilization": where.memory_share,
            "stop_token_ids": list(self.attrs.eos_token_ids),
            "prompts": [
                {"prompt": tokens[:n].tolist(), "max_tokens": compat.completion_limit(n)} for tokens, n in self.texts
            ],
        }

    def run(self, drafter: str, block_size: int, replayed: list[Rounds], where: EngineDevice) -> dict:
        """replayed: replay's chain rounds of the same prompts, in the same order; where: the engine's device."""
        t0 = time.perf_counter()
        result = call_worker(self.python, self.request(drafter, block_size, where), self.log, where.env())
        seconds = time.perf_counter() - t0
        stored = [tokens[n:] for tokens, n in self.texts]
        return {
            "engine": f"vllm {result['vllm']}",
            "device": where.text(),
            "seconds": round(seconds, 1),
            **compare(stored, result["requests"], replayed, block_size),
            "vllm_metrics": result["metrics"],
        }


def check_python(python: str) -> None:
    """Before any replay: `python` runs and finds vLLM (a lookup, not an import: seconds, not minutes)."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        found = subprocess.run([python, "-c", probe], capture_output=True).returncode == 0
    except OSError as e:
        raise EngineError(f"--served-python {python}: cannot run it ({e.strerror or e})") from None
    if not found:
        raise EngineError(f"--served-python {python}: vLLM is not installed there; give the Python of vLLM's venv")


def call_worker(python: str, request: dict, log, env: dict | None = None) -> dict:
    """Run vllm_worker.py under `python` (its environment: ours plus env); its result, or an
    EngineError naming its log."""
    with tempfile.TemporaryDirectory(prefix="dflash-served-") as tmp:
        req, out, log_path = Path(tmp) / "request.json", Path(tmp) / "result.json", Path(tmp) / "vllm.log"
        req.write_text(json.dumps(request))
        log(f"serving {len(request['prompts'])} prompts with vLLM ({python}), drafter {request['drafter']}")
        with log_path.open("wb") as fh:
            code = subprocess.run(
                [python, str(WORKER), str(req), str(out)],
                stdout=fh,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            ).returncode
        result = json.loads(out.read_text()) if out.exists() else {}
        if code != 0 or "requests" not in result:
            lines = log_path.read_text(errors="replace").strip().splitlines()
            tail = first_error(lines) or lines[-1:] or ["no output"]
            kept = Path(tempfile.gettempdir()) / f"dflash-served-{os.getpid()}.log"
            os.replace(log_path, kept)
            raise EngineError(f"--served vllm: {result.get('error') or tail[0]} (exit {code}; log {kept})")
    return result


def first_error(lines: list[str]) -> list[str]:
    """The root cause in an engine's log: the first 'SomethingError: message' (its worker processes
    log it, prefixed, before the main process raises a generic exception); else the first exception."""
    for pattern in (r"\b(\w+Error: \S.*)", r"\b(\w*Exception: \S.*)"):
        found = [m.group(1) for m in map(re.compile(pattern).search, lines) if m]
        if found:
            return found[:1]
    return []


def served_rounds(tokens: list[int], accepted: list[int]) -> Rounds:
    """vLLM's accepted drafts per step -> rounds in replay's convention: each commits accepted + 1,
    cut to the completion tokens left after the prefill's first one."""
    left, rounds = len(tokens) - 1, []
    for acc in accepted:
        rounds.append((min(acc, left), round_tokens(acc, left)))
        left -= rounds[-1][1]
    return rounds


def compare(stored: list, served: list[dict], replayed: list[Rounds], block_size: int) -> dict:
    """Served against replay, over the prompts whose served completion equals the stored one and over all.
    stored: per prompt, its stored completion (array or list)."""
    rounds = [served_rounds(r["token_ids"], r["accepted"]) for r in served]
    same = [i for i, (a, r) in enumerate(zip(stored, served)) if np.array_equal(a, r["token_ids"])]

    def side_by_side(idx: list[int]) -> dict:
        s, r = summarize([rounds[i] for i in idx], block_size), summarize([replayed[i] for i in idx], block_size)
        return {
            "prompts": len(idx),
            "served_tau": s["tau"],
            "replay_tau": r["tau"],
            "difference": s["tau"] / r["tau"] - 1 if idx else float("nan"),
            "served_per_slot": s["per_slot"],
            "replay_per_slot": r["per_slot"],
        }

    vllm_means = [sum(a + 1 for a in r["accepted"]) / len(r["accepted"]) for r in served if r["accepted"]]
    return {
        "prompts": len(served),
        "identical_completions": len(same),
        "identical_rounds": sum(rounds[i] == replayed[i] for i in same),
        "agreeing": side_by_side(same),
        "all": side_by_side(list(range(len(served)))),
        "vllm_convention_tau": sum(vllm_means) / len(vllm_means) if vllm_means else float("nan"),
    }
