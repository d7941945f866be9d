"""`pipeline extract --capture vllm`: the tap states captured inside vLLM instead of by the target
loaded here (pipeline/target/model.py's `Target.capture`), through one engine kept for the run.

The engine runs in the user's vLLM Python (`--capture-python`) as vllm_capture_worker.py, one
process for every batch of the run: a line of token ids goes in, a line of file paths comes back,
one safetensors file a sequence that the engine's KV connector (vllm_capture_connector.py) wrote;
the states never pass through JSON. Each file is read, checked (its token ids are the sequence
sent, its shape [T, n_taps, H], no position without a state) and deleted, and the batch comes back
as `Target.capture` returns it: hidden [sum T, n_taps, H] bf16 on the host, sequences back to back.

This lives in stages/extract/ and not in pipeline/target/ because it is a run's arrangement, not the
model: a process started and stopped with the run, the user's flags for it, a directory for its
files; the target (tokenizer, vocabulary, identity record) is still the one pipeline/target/ loads,
without its weights unless this process generates the references (loading.load's with_weights).

Tap convention: the project's tap k (the output of decoder layer k, 0-based) is vLLM's aux layer id
k+1 (vLLM's id L is the residual stream after L layers, id 0 the embedding), as its DFlash support
converts `target_layer_ids` too. tests/stages/extract/test_engine_capture.py proves it against
transformers, against k and k+2, and against the final norm.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pipeline.errors import EngineError
from pipeline.target.model import cut
from store.errors import ConfigError
from store.format.schema import Backends

WORKER = Path(__file__).with_name("vllm_capture_worker.py")
MIN_VERSION = (0, 32)  # extract_hidden_states with the hidden-states connector; the version tested
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def vllm_layer_ids(taps: list[int]) -> list[int]:
    """The project's taps (output of layer k) as vLLM's aux layer ids (k + 1)."""
    return [k + 1 for k in taps]


def check_python(python: str) -> str:
    """vLLM's version in `python`, or one line saying why it cannot capture (cannot run, no vLLM,
    older than MIN_VERSION). Imports vLLM: seconds, before anything is claimed or loaded."""
    probe = "import vllm; print(vllm.__version__)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    except OSError as e:
        raise EngineError(f"--capture-python {python}: cannot run it ({e.strerror or e})") from None
    if done.returncode != 0:
        why = (first_error(done.stderr.splitlines()) or ["vllm does not import"])[0]
        raise EngineError(f"--capture-python {python}: cannot import vllm ({why}); give the Python of vLLM's venv")
    version = done.stdout.strip().splitlines()[-1]
    numbers = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
    if numbers < MIN_VERSION:
        raise EngineError(
            f"--capture-python {python}: vLLM {version} is older than "
            f"{'.'.join(map(str, MIN_VERSION))}, the first with the extract_hidden_states capture tested here"
        )
    return version


def first_error(lines: list[str]) -> list[str]:
    """The root cause in an engine's log: its first 'SomethingError: message' (none: [])."""
    return [m.group(1) for m in map(re.compile(r"\b(\w+Error: \S.*)").search, lines) if m][:1]


def check_split(config, tensor_parallel: int) -> None:
    """Refuse, in one line, a tensor-parallel size that does not divide the target's Gated DeltaNet
    heads: vLLM 0.32 splits them over its ranks without checking, and its first forward fails on a
    shape (qwen_gdn_linear_attn.py, rearrange_mixed_qkv: a rank's share of one 64-wide key head is 32
    values). Its attention heads vLLM checks itself. config: the target's transformers config."""
    for name in ("linear_num_key_heads", "linear_num_value_heads"):
        heads = getattr(config, name, None)
        if heads is not None and heads % tensor_parallel:
            raise ConfigError(
                "--capture-tp",
                tensor_parallel,
                f"must divide the target's {name} ({heads}): vLLM splits the Gated DeltaNet heads over its ranks",
            )


# What a launcher (torchrun, accelerate) sets for its own process group: kept from the engine, which
# starts a group of its own (its tensor-parallel ranks) and would otherwise join or clash with ours.
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def engine_env(env: dict, device: str, world: int, per_engine: int, gpus: int) -> dict:
    """The engine's environment: this process's, less its launcher's variables, and under a launcher on
    CUDA (world > 1, device cuda:R) its own GPUs: R*n to R*n + n - 1 (n = per_engine, the engine's
    tensor x pipeline size) of those this process sees (CUDA_VISIBLE_DEVICES, else the `gpus` there
    are), so the engines of one node's processes share no GPU. More engines than GPUs: one line."""
    out = {k: v for k, v in env.items() if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    if world == 1 or not device.startswith("cuda:"):
        return out
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = [i.strip() for i in visible.split(",") if i.strip()] if visible else [str(i) for i in range(gpus)]
    first = int(device.split(":")[1]) * per_engine
    last = first + per_engine - 1
    if last >= len(ids):
        raise EngineError(
            f"--capture vllm: the engine of local rank {first // per_engine} needs GPUs {first}-{last} ({per_engine} "
            f"a process: --capture-tp x --capture-pp) but this process sees {len(ids)}; start at most "
            f"{len(ids) // per_engine} process(es) a node"
        )
    out["CUDA_VISIBLE_DEVICES"] = ",".join(ids[first : first + per_engine])
    return out


def backends(requested: str) -> Backends:
    """The kernels record of a store whose states the engine computed: its own, not observed here."""
    return Backends(
        linear_attention="vllm",
        conv1d="vllm",
        linear_attention_requested=requested,
        attention="vllm",
        kernel_calls={},
    )


class VllmCapture:
    """One vLLM engine capturing the taps of `target`, started by `start()`, stopped by `close()`."""

    def __init__(
        self,
        python: str,
        target: str,
        taps: list[int],
        hidden_size: int,
        dtype: str,
        max_model_len: int,
        memory_share: float | None,
        version: str | None = None,
        *,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        quantization: str | None = None,
        env: dict | None = None,
    ) -> None:
        """version: vLLM's in `python` when already checked (check_python), else checked by start().
        quantization: vLLM's `quantization=` (None: the checkpoint's own, none if it has none).
        env: the engine's environment (`engine_env`; None: this process's)."""
        self.env = dict(os.environ if env is None else env)
        self.python, self.target, self.taps, self.hidden_size = python, target, list(taps), hidden_size
        self.dtype, self.max_model_len, self.memory_share = DTYPES[dtype], max_model_len, memory_share
        self.version = version
        self.requested = {
            "tensor_parallel_size": tensor_parallel,
            "pipeline_parallel_size": pipeline_parallel,
            "quantization": quantization,
        }
        self.layout: dict | None = None  # what the engine reports it runs with (its ready reply)
        self.log: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.dir: Path | None = None
        # seconds waiting for the engine's replies (its forwards and its connector's writes), and
        # reading, checking and deleting its files here (the transport's share on this side)
        self.seconds = {"start_s": 0.0, "engine_s": 0.0, "transport_s": 0.0, "generate_s": 0.0}

    @property
    def record(self) -> dict:
        """How the states were made, as the store's conditioning records it: the parallel layout,
        quantization and kernels are the ones the started engine reports, not the ones asked for."""
        assert self.layout is not None, "the engine reports its layout once started"
        return {
            "engine": "vllm",
            "version": self.version,
            "dtype": self.dtype,
            "tensor_parallel": self.layout["tensor_parallel"],
            "pipeline_parallel": self.layout["pipeline_parallel"],
            "quantization": self.layout["quantization"],
            "checkpoint_quantization": self.layout["checkpoint_quantization"],
            "kernels": self.layout["kernels"],
            "layer_ids": vllm_layer_ids(self.taps),
        }

    def start(self) -> VllmCapture:
        """The engine up (minutes on CPU), or one line naming its log."""
        t = time.perf_counter()
        self.version = self.version or check_python(self.python)
        self.dir = Path(tempfile.mkdtemp(prefix="dflash-capture-"))
        config = {
            "target": str(self.target),
            "layer_ids": vllm_layer_ids(self.taps),
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": self.memory_share,
            **self.requested,
            "transport_dir": str(self.dir / "states"),
            "seed": 0,
        }
        (self.dir / "config.json").write_text(json.dumps(config))
        self.log = self.dir / "vllm.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [self.python, str(WORKER), str(self.dir / "config.json")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env={**self.env, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,  # its engine processes with it: close() can stop them all
            )
        reply = self._reply()
        if reply.get("hidden_size") != self.hidden_size:
            self._fail(f"the engine's hidden size {reply.get('hidden_size')} is not the target's {self.hidden_size}")
        self.layout = reply["layout"]
        self.seconds["start_s"] = time.perf_counter() - t
        return self

    def capture(
        self,
        seqs: list[list[int]],
        taps: list[int],
        prompt_lens: list[int] | None = None,
        *,
        rounding=None,
        budget: int | None = None,
    ):
        """As Target.capture: hidden [sum(len(s)), n_taps, H] bf16 on the host, and with prompt_lens the
        agreement (matches, tokens). The engine schedules its own forwards, so budget is not used."""
        assert taps == self.taps, "the engine captures the taps it was started with"
        t = time.perf_counter()
        self._send({"seqs": seqs, "prompt_lens": prompt_lens})
        reply = self._reply()
        t_reply = time.perf_counter()
        hidden = torch.cat([self._states(path, seq) for path, seq in zip(reply["files"], seqs)])
        self.seconds["engine_s"] += t_reply - t
        self.seconds["transport_s"] += time.perf_counter() - t_reply
        hidden = hidden if rounding is None else rounding(hidden)
        if prompt_lens is None:
            return hidden
        return hidden, (sum(reply["matches"]), sum(len(s) - p for s, p in zip(seqs, prompt_lens)))

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int], eos_ids: list[int]) -> list[list[int]]:
        """As Target.generate: each prompt's greedy completion by the engine, cut at its first EOS
        (kept) and its limit; the references of --responses regenerate, so the target is loaded once."""
        wanted = [i for i, n in enumerate(max_new_tokens) if n > 0]
        completions: list[list[int]] = [[] for _ in prompts]
        if not wanted:
            return completions
        t = time.perf_counter()
        request = {
            "prompts": [prompts[i] for i in wanted],
            "max_tokens": [max_new_tokens[i] for i in wanted],
            "stop_token_ids": list(eos_ids),
        }
        self._send(request)
        for i, completion in zip(wanted, self._reply()["completions"]):
            completions[i] = cut(completion, eos_ids, max_new_tokens[i])
        self.seconds["generate_s"] += time.perf_counter() - t
        return completions

    def _send(self, request: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the engine is gone: _reply names its exit and its log's error

    def _states(self, path: str, seq: list[int]) -> torch.Tensor:
        """One sequence's states [T, n_taps, H] bf16, checked, its file deleted."""
        from safetensors.torch import load_file

        try:
            data = load_file(path)
        finally:
            Path(path).unlink(missing_ok=True)
        states, ids = data["hidden_states"], data["token_ids"]
        if ids.tolist() != seq:
            self._fail(f"{path} holds the states of other tokens than the sequence sent ({len(ids)} ids)")
        if tuple(states.shape) != (len(seq), len(self.taps), self.hidden_size):
            self._fail(f"{path}: states {tuple(states.shape)}, expected {(len(seq), len(self.taps), self.hidden_size)}")
        empty = (states == 0).all(dim=-1).any(dim=-1).nonzero().flatten().tolist()  # positions with a zero tap
        if empty:
            self._fail(
                f"{path}: no state at position(s) {empty[:8]} of {len(seq)} (all zeros): the store would lack them"
            )
        return states.to(torch.bfloat16)

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            how = f"killed by signal {-code}" if code < 0 else f"exit {code}"
            error = first_error(self.log.read_text(errors="replace").splitlines())
            self._fail(f"the engine stopped ({how})" + (f": {error[0]}" if error else ""))
        reply = json.loads(line)
        if "error" in reply:
            self._fail(reply["error"])
        return reply

    def _fail(self, why: str):
        kept = Path(tempfile.gettempdir()) / f"dflash-capture-{os.getpid()}.log"
        if self.log is not None and self.log.exists():
            shutil.copyfile(self.log, kept)
        raise EngineError(f"--capture vllm: {why} (log {kept})")

    def close(self) -> None:
        """The engine stopped (end of input, then killed if it does not leave), its files removed."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
