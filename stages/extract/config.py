"""Stage one's settings: every `pipeline extract` flag, its default and its help."""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass

from pipeline import DEFAULT_PROMPTS, TINY_TARGET
from pipeline import device as devices
from pipeline.target.taps import DEFAULT_NUM_TAPS
from stages.settings import at_least, check_choices, fill, flag_of, require, setting
from store.errors import ConfigError
from store.format import hidden_formats, layout
from store.format.schema import Sampling
from store.io.locks import LEASE_S

# Shards of a new store unless --num-shards says otherwise: one per ROWS_PER_SHARD rows, at least
# MIN_SHARDS. A shard is the unit of work, of commit and of retry, so it stays small at any scale
# (2.5M rows: 2,442 shards of ~1k samples, minutes of GPU time each; the tiny prompt set: 64).
ROWS_PER_SHARD = 1024
MIN_SHARDS = 64


def default_num_shards(rows: int) -> int:
    return max(MIN_SHARDS, -(-rows // ROWS_PER_SHARD))


@dataclass(frozen=True, kw_only=True)
class ExtractConfig:
    store: str = setting("hs.zarr", "Store path or fsspec URL (created if absent).")
    shards: str = setting(
        "all", "Shards to write, e.g. 'all', '0-63' or '0-3,8,10-12' (processes under a launcher share them)."
    )
    redo: bool = setting(
        False,
        "Re-check the committed shards among --shards (every byte, as `pipeline verify` "
        "does) and delete and redo those that fail; the sound ones are kept. A damaged "
        "store root (attributes, embedding, lm_head) is rebuilt when this run's settings "
        "are the ones it was made with (give --num-shards too).",
    )
    num_shards: int | None = setting(
        None,
        "Shards the dataset is split into; fixed when the store is created.",
        default_text=f"the store's, or one per {ROWS_PER_SHARD} rows, at least {MIN_SHARDS}",
    )
    target: str | None = setting(None, "Target model directory or hub id.", default_text="the shipped tiny target")
    dataset: str | None = setting(
        None,
        "Prompts: .jsonl, .json, .parquet, a saved `datasets` directory or a hub dataset name.",
        default_text="the shipped prompt set",
    )
    split: str = setting("train", "Split, for `datasets` sources.")
    messages_field: str = setting(
        "messages",
        "Field holding chat turns: {role, content} or ShareGPT {from, value} "
        "(rows without it are read from 'conversations').",
    )
    prompt_field: str = setting("prompt", "Field holding a plain prompt (if no messages).")
    response_field: str = setting(
        "response",
        "Field holding the response for plain prompts (--responses dataset); "
        "a row may instead carry it as token ids in '<this>_ids' (e.g. "
        "response_ids, an engine's output generated offline), used verbatim.",
    )
    responses: str = setting(
        "regenerate",
        "regenerate: the target's greedy completion, generated here (with --capture vllm, by the capturing "
        "engine: the target is loaded once); server: the "
        "greedy completion of the engine at --server-url (vLLM, SGLang); dataset: "
        "the dataset's own assistant turn. --temperature samples the first two instead.",
        choices=("regenerate", "server", "dataset"),
    )
    temperature: float = setting(
        0.0,
        "Sample the references (--responses regenerate or server) at this temperature; 0: greedy. Reproducible "
        "row by row: a row's completion depends on --seed, its dataset row and its own logits only, never on "
        "the rows beside it or the shards' order (the batch size only through the target's numerics, as "
        "greedy's near-ties; a server's rows only where its seeded sampling is batch-invariant: docs/extraction.md). "
        "Recorded in the store.",
    )
    top_p: float | None = setting(
        None,
        "With --temperature: sample from the smallest set of the most likely tokens of this mass, in (0, 1].",
        default_text="none",
    )
    top_k: int | None = setting(
        None, "With --temperature: sample from this many most likely tokens (0: all).", default_text="none"
    )
    seed: int | None = setting(
        None,
        "With --temperature: the seed each row's own seed is derived from (with its dataset row).",
        default_text="0 with --temperature",
    )
    turns: str = setting(
        "last",
        "With --responses dataset, which assistant turns of a multi-turn row carry the loss: "
        "last (the final answer; earlier turns are context), all (every assistant turn in "
        "one sample, the turns between them as context) or split (one sample per assistant "
        "turn, each rendered as the last turn: for templates that drop reasoning from "
        "history).",
        choices=("last", "all", "split"),
    )
    category_field: str | None = setting(
        None,
        "Field holding a row's label (its benchmark, source or domain: text or a number), stored per sample; "
        "evaluate.py then reports tau per label.",
        default_text="none",
    )
    chat_template_kwargs: str | None = setting(
        None,
        "Arguments for the chat template at every rendering (prompts, --turns, answers), as a JSON object, "
        "e.g. '{\"enable_thinking\": false}'. Recorded in the store (part of its fingerprint).",
        default_text="none",
    )
    template_kwargs_field: str | None = setting(
        None,
        "Field holding a row's own chat-template arguments (an object or its JSON text), applied over "
        "--chat-template-kwargs, so one store can mix modes (thinking on and off); the summary counts rows per "
        "mode.",
        default_text="none",
    )
    server_url: str | None = setting(
        None,
        "OpenAI-compatible server (vLLM, SGLang) serving the target, for "
        "--responses server, e.g. http://127.0.0.1:8000 (or the OpenAI "
        "clients' form, http://127.0.0.1:8000/v1).",
    )
    server_model: str | None = setting(None, "The served model to ask.", default_text="the only one served")
    concurrency: int = setting(64, "Requests in flight to the server (it batches them).")
    server_timeout_s: float = setting(600.0, "Seconds one request may take; transient failures are retried.")
    max_new_tokens: int = setting(256, "Completion length limit.")
    max_length: int = setting(1024, "Prompt + completion limit; longer prompts are skipped and counted.")
    batch_size: int = setting(
        16,
        "Prompts read, prepared and completed together (one `generate` batch with --responses regenerate); "
        "their capture runs in forwards of --capture-tokens.",
    )
    capture_tokens: int = setting(
        16384,
        "Token positions one capture forward computes, padding included: a batch's rows are captured "
        "longest first, right-padded, as many to a forward as fit (no attention mask is built); a row "
        "longer than this is captured in chunks (of this, rounded down to a multiple of 64) through the "
        "target's cache. Sizes the device memory besides the weights; does not change the states beyond "
        "one bf16 rounding step in a few values (docs/extraction.md).",
    )
    device: str | None = setting(None, "torch device.", default_text=devices.AUTO)
    dtype: str = setting(
        "bf16", "Dtype the target runs in (states are stored as bf16 either way).", choices=devices.DTYPE_NAMES
    )
    linear_attention: str = setting(
        "auto",
        "Gated DeltaNet kernels: auto = fla on CUDA when installed, else the PyTorch fallback (always the "
        "fallback without CUDA); fla = the fla kernels, on CUDA, or on CPU under Triton's interpreter "
        "(TRITON_INTERPRET=1: their code, slowly, for parity checks; docs/performance.md). What actually ran "
        "is recorded in the store.",
        choices=("auto", "fla", "torch"),
    )
    capture: str = setting(
        "transformers",
        "What computes the tap states: transformers, the target loaded here (one forward per batch, "
        "--capture-tokens); vllm, the target served by vLLM in its own Python (--capture-python), "
        "prefill only, its states written by vLLM's KV connector and read back here. The engine "
        "and its version are recorded in the store's conditioning: drafters trained on one are "
        "refused on the other's states unless allowed (docs/extraction.md, 'Capture inside vLLM').",
        choices=("transformers", "vllm"),
    )
    capture_python: str | None = setting(
        None, "The Python that has vLLM installed (its own venv), for --capture vllm.", default_text="this Python"
    )
    capture_memory: float | None = setting(
        None,
        "Share of the device's memory the --capture vllm engine may take (vLLM's "
        "gpu_memory_utilization; on CPU a share of host memory).",
        default_text="vLLM's default",
    )
    capture_tp: int | None = setting(
        None,
        "Tensor-parallel size of the --capture vllm engine (vLLM's tensor_parallel_size): the devices "
        "one engine spreads each layer over. Data parallel is not an engine setting here: run several "
        "`pipeline extract` processes (one engine each, under a launcher or on several nodes), which "
        "claim shards by leases. Recorded in the store's conditioning.",
        default_text="1",
    )
    capture_pp: int | None = setting(
        None,
        "Pipeline-parallel size of the --capture vllm engine (vLLM's pipeline_parallel_size): the "
        "devices its layers are split across. Recorded in the store's conditioning. vLLM 0.32 refuses "
        "more than 1 with the capture's extract_hidden_states method (its draft model has no "
        "pipeline-parallel support), in one line before any shard is claimed.",
        default_text="1",
    )
    capture_quantization: str | None = setting(
        None,
        "Quantization the --capture vllm engine applies (vLLM's quantization=, e.g. fp8_per_tensor: "
        "FP8 weights made from a bf16 checkpoint at load). The states change with it: what the engine "
        "ran with is recorded in the store's conditioning, so drafters trained on unquantized states "
        "are refused on them unless allowed.",
        default_text="the checkpoint's own (none if it has none)",
    )
    taps: str | None = setting(
        None,
        "Tap layers: '1,16,31' (layer ids, 0-based; tap k = output of layer k) or 'n=5'.",
        default_text=f"the DFlash formula with {DEFAULT_NUM_TAPS} taps",
    )
    mask_token_id: int | None = setting(None, "Drafter mask token.", default_text="the tokenizer's mask token")
    chunk_tokens: int = setting(256, "Tokens per compressed chunk.")
    shard_tokens: int = setting(
        16384,
        "Tokens per zarr shard file (a multiple of --chunk-tokens; before format revision 5 the default was 4096).",
    )
    compression_level: int = setting(
        layout.DEFAULT_LEVEL,
        "zstd level of the states' high bytes (bf16; the low bytes "
        "are LZ4) or of their e4m3 bytes (fp8), %d to %d; every "
        "chunk ends in a crc32c." % layout.LEVELS,
    )
    hidden_format: str = setting(
        "bf16",
        "How the states are stored: bf16, the target's states bit for bit (byte-plane coded, about 0.65x raw "
        "at 27B width), or fp8: each rounded to e4m3 times a power of two per token and tap (the largest value "
        "never saturates; relative RMS error 2.7%) and coded losslessly from there, 0.35-0.41x raw at 27B "
        "width. Read back as bf16 either way; fixed when the store is created and part of its conditioning "
        "(docs/store.md).",
        choices=hidden_formats.NAMES,
    )
    final_state: bool = setting(
        False,
        "Also store, per token, the target's state after its final norm (what its lm_head consumes: Hugging "
        "Face hidden_states[-1]) as each shard's `final_state` array, in the store's hidden format: +1/taps of "
        "the states' bytes (+20% at 5 taps); for soft targets and tau at temperature. Each shard is checked as "
        "it is written: the argmax of lm_head(stored final state) must be the next reference token (at least "
        "90% of completion tokens, greedy references only) and the states of unit RMS under the final norm's "
        "gain; a shard that fails stops the run. Fixed when the store is created. Not with --capture vllm "
        "(its states are pre-norm residual streams, and the final norm is not loaded there).",
    )
    agreement: bool = setting(
        True,
        "Run the capture forward on to the target's lm_head along each completion and "
        "record how often the completion token is the target's own argmax (per shard and "
        "in `pipeline info`; ~100% for regenerated references, lower for another engine "
        "on near-ties; low means a wrong server, template or tokenizer). For sampled references "
        "(--temperature) the rate is reported, not judged: it falls with the temperature.",
    )
    writer_threads: int = setting(
        2,
        "Threads that compress states, each about one core: at 27B width one writes "
        "400-600 MB/s of raw states (bf16 or fp8), and a GPU captures ~500 MB/s.",
    )
    writer_memory_gb: float = setting(
        4.0,
        "Host memory, in GiB, for states captured but not yet written; the "
        "capture waits beyond it, except while the writer waits to fill a shard file.",
    )
    skip_nonfinite: bool = setting(
        False,
        "Leave out rows whose captured states hold NaN or Inf and count them (skipped "
        "rows 'nonfinite', per shard and in the summary). Without it such a row "
        "stops the run, naming the shard and the dataset row, and that shard is not "
        "committed.",
    )
    lease_s: float = setting(
        LEASE_S,
        "Seconds a process's claim on a shard, or on creating the store, outlives its "
        "last renewal (every 30 s, or every quarter of the lease when shorter): a dead "
        "node's shards are taken over by the next process that wants them after this "
        "long. POSIX file systems and S3; on S3 the longer of this and the holder's own "
        "applies (docs/reliability.md).",
    )
    ignore_free_space: bool = setting(
        False,
        "Start even when the store's file system has less free space than the "
        "estimate printed at the start (measured from the store's committed "
        "shards, else from the length limits). Not checked for object stores. "
        "A disk that fills up stops the run with one line either way; committed "
        "shards are kept and a rerun completes the store.",
    )

    def __post_init__(self) -> None:
        fill(self, "target", self.target or str(TINY_TARGET))
        fill(self, "dataset", self.dataset or str(DEFAULT_PROMPTS))
        check_choices(self)
        require(
            self,
            "server_url",
            bool(self.server_url) == (self.responses == "server"),
            "goes with --responses server, and it needs one",
        )
        at_least(
            self,
            1,
            "max_new_tokens",
            "max_length",
            "batch_size",
            "capture_tokens",
            "chunk_tokens",
            "shard_tokens",
            "num_shards",
            "concurrency",
            "writer_threads",
        )
        self.check_sampling()
        require(
            self,
            "turns",
            self.turns == "last" or self.responses == "dataset",
            f"{self.turns} goes with --responses dataset (regenerated answers exist only for the last turn)",
        )
        require(
            self,
            "capture_python",
            self.capture_python is None or self.capture == "vllm",
            "goes with --capture vllm",
        )
        require(
            self,
            "capture_memory",
            self.capture_memory is None or (self.capture == "vllm" and 0 < self.capture_memory <= 1),
            "goes with --capture vllm, a share of the device's memory in (0, 1]",
        )
        require(
            self,
            "final_state",
            not self.final_state or self.capture == "transformers",
            "goes with --capture transformers: vLLM's aux states are pre-norm residual streams and the "
            "target's final norm is not loaded with --capture vllm",
        )
        require(
            self,
            "final_state",
            not self.final_state or self.agreement,
            "checks each shard by the agreement of the stored final state: drop --no-agreement",
        )
        for name in ("capture_tp", "capture_pp"):
            size = getattr(self, name)
            require(self, name, size is None or self.capture == "vllm", "goes with --capture vllm")
            require(self, name, size is None or size >= 1, "must be at least 1")
        quantization = self.capture_quantization
        require(
            self, "capture_quantization", quantization is None or self.capture == "vllm", "goes with --capture vllm"
        )
        require(
            self,
            "capture_quantization",
            quantization is None or re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", quantization) is not None,
            "must be a vLLM quantization method's name (lower case), e.g. fp8_per_tensor",
        )
        if self.capture == "vllm":
            fill(self, "capture_python", self.capture_python or sys.executable)
            fill(self, "capture_tp", self.capture_tp or 1)
            fill(self, "capture_pp", self.capture_pp or 1)
        require(self, "writer_memory_gb", self.writer_memory_gb > 0, "must be positive")
        require(self, "lease_s", self.lease_s >= 2, "must be at least 2 seconds (S3 times leases to the second)")
        lo, hi = layout.LEVELS
        require(self, "compression_level", lo <= self.compression_level <= hi, f"levels run {lo} to {hi}")
        require(
            self,
            "shard_tokens",
            self.shard_tokens % self.chunk_tokens == 0,
            f"must be a multiple of --chunk-tokens {self.chunk_tokens}",
        )
        try:
            args = json.loads(self.chat_template_kwargs or "{}")
        except ValueError as e:
            raise ConfigError(
                flag_of(self, "chat_template_kwargs"), self.chat_template_kwargs, f"is not JSON ({e})"
            ) from None
        require(
            self,
            "chat_template_kwargs",
            isinstance(args, dict),
            "must be a JSON object, e.g. '{\"enable_thinking\": false}'",
        )
        fill(self, "device", self.device or devices.default_device())  # last: it imports torch, the checks need none

    def check_sampling(self) -> None:
        """--temperature and its cuts and seed: only for references drawn here or by a server, the cuts
        and the seed only when sampling; top-k 0 and top-p 1 cut nothing and are recorded as none."""
        require(self, "temperature", math.isfinite(self.temperature) and self.temperature >= 0, "must be at least 0")
        require(
            self,
            "temperature",
            self.temperature == 0 or self.responses != "dataset",
            "goes with --responses regenerate or server (the dataset's responses are not sampled here)",
        )
        require(
            self,
            "temperature",
            self.temperature == 0 or not (self.capture == "vllm" and self.responses == "regenerate"),
            "not with --capture vllm --responses regenerate: the capturing engine samples through its "
            "speculative path, where a seeded row is not reproducible (the same seed twice in one batch gave "
            "two rows); draw them with --responses server from a plain engine, or capture with transformers",
        )
        for name in ("top_p", "top_k", "seed"):
            require(self, name, getattr(self, name) is None or self.temperature > 0, "goes with --temperature above 0")
        require(self, "top_p", self.top_p is None or 0 < self.top_p <= 1, "must be in (0, 1]")
        at_least(self, 0, "top_k", "seed")
        fill(self, "temperature", float(self.temperature))  # 1 and 1.0 record alike (the fingerprint hashes JSON)
        fill(self, "top_p", None if self.top_p in (None, 1) else float(self.top_p))
        fill(self, "top_k", self.top_k or None)
        if self.temperature > 0:
            fill(self, "seed", self.seed or 0)

    def sampling(self) -> Sampling | None:
        """How the references are sampled, as the store records it; None: greedy."""
        if self.temperature == 0:
            return None
        return Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed)

    def template_args(self) -> dict:
        """--chat-template-kwargs as a dict."""
        return json.loads(self.chat_template_kwargs or "{}")
