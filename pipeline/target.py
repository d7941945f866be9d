"""The target model: loaded as the text-only causal LM, greedy generation, and tap capture.

`capture` runs ONE forward over prompt+completion and keeps the OUTPUT of decoder layer k for
every tap k (Hugging Face `hidden_states[k+1]`), taken by forward hooks on the layers
themselves; the forward stops after the last tap, so later layers, the final norm and lm_head
never run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import GenerationConfig

from pipeline import fingerprint
from pipeline.errors import PipelineError
from pipeline.kernels import KernelRecorder, select_linear_attention

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
WEIGHT_SUFFIXES = (".safetensors", ".bin")


class _StopForward(Exception):
    """Raised by the last tap's hook: nothing after it is needed."""


@dataclass
class Target:
    model: torch.nn.Module
    tokenizer: object
    path: Path
    device: torch.device
    dtype: torch.dtype
    recorder: KernelRecorder
    requested_linear_attention: str
    info: dict = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def layers(self) -> torch.nn.ModuleList:
        return self.model.get_decoder().layers

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def eos_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return [eos] if isinstance(eos, int) else list(eos)

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.eos_ids[0]

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[list[int]]:
        """Greedy completions, batched with left padding; each cut at its first EOS (kept) and limit."""
        if not prompts:
            return []
        longest = max(max_new_tokens)
        if longest <= 0:
            return [[] for _ in prompts]
        ids, mask = self._pad(prompts, left=True)
        width = ids.shape[1]
        # A fresh config: pure argmax, none of the checkpoint's sampling or repetition settings.
        config = GenerationConfig(max_new_tokens=longest, do_sample=False, num_beams=1, eos_token_id=self.eos_ids,
                                  pad_token_id=self.pad_id, use_cache=True)
        with self.recorder.recording():
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      generation_config=config)
        new = out[:, width:].tolist()
        return [_cut(seq, self.eos_ids, limit) for seq, limit in zip(new, max_new_tokens)]

    @torch.inference_mode()
    def capture(self, seqs: list[list[int]], taps: list[int]) -> torch.Tensor:
        """Tap outputs for each sequence, concatenated along tokens.

        Returns hidden: [sum(len(s)), n_taps, H] bf16 on CPU, in sequence order.
        Right padding: every real token sees only real tokens before it (causal model).
        """
        ids, mask = self._pad(seqs, left=False)
        grabbed: dict[int, torch.Tensor] = {}

        def hook_for(k: int):
            def hook(_module, _inputs, output):
                grabbed[k] = output[0] if isinstance(output, tuple) else output
                if k == taps[-1]:
                    raise _StopForward
            return hook

        handles = [self.layers[k].register_forward_hook(hook_for(k)) for k in taps]
        try:
            with self.recorder.recording():
                self.model.get_decoder()(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False)
        except _StopForward:
            pass
        finally:
            for h in handles:
                h.remove()
        stacked = torch.stack([grabbed[k] for k in taps], dim=2).to(torch.bfloat16)  # [B, W, n_taps, H]
        valid = mask.to(stacked.device).bool()
        return stacked[valid].cpu()  # [T, n_taps, H]; boolean indexing keeps row-major (sequence) order

    def _pad(self, seqs: list[list[int]], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, attention mask: [B, W] long, padded on the left (generation) or the right (capture)."""
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            cols = slice(width - len(s), width) if left else slice(0, len(s))
            ids[i, cols] = torch.tensor(s)
            mask[i, cols] = 1
        return ids, mask

    def probe(self) -> dict:
        """A short generate + capture so the recorder sees which kernels serve prefill and decode."""
        ids = self.tokenizer("def probe(x):\n    return", add_special_tokens=False).input_ids
        self.generate([ids], [2])
        self.capture([ids], [0])
        return self.backends()

    def backends(self) -> dict:
        kernels = self.recorder.summary()
        return {
            "linear_attention": kernels["linear_attention"],
            "conv1d": kernels["conv1d"],
            "linear_attention_requested": self.requested_linear_attention,
            "attention": getattr(self.model.config, "_attn_implementation", None),
            "kernel_calls": kernels["calls"],
        }

    def check_backends(self) -> dict:
        """What ran must be what was chosen: fla on CUDA when installed, the PyTorch path otherwise."""
        b = self.backends()
        ran, wanted = b["linear_attention"], self.requested_linear_attention
        if ran not in (wanted, "none"):
            raise PipelineError(
                f"linear attention ran on '{ran}' but '{wanted}' was chosen for {self.device.type} "
                f"(calls: {b['kernel_calls']}); was the model code imported before the kernels were chosen?")
        return b


def _cut(seq: list[int], eos_ids: list[int], limit: int) -> list[int]:
    seq = seq[:limit]
    for i, t in enumerate(seq):
        if t in eos_ids:
            return seq[: i + 1]
    return seq


def resolve(target: str) -> Path:
    """A local directory for a target path or hub id (the hub cache must already hold it offline)."""
    path = Path(target).expanduser()
    if path.is_dir():
        return path
    if path.exists() or target.startswith((".", "/", "~")):
        raise PipelineError(f"--target {target}: not a model directory")
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(target))
    except Exception as e:  # network, auth, unknown id: one line for the user
        raise PipelineError(f"--target {target}: cannot resolve it as a directory or hub id ({type(e).__name__}: {e})".splitlines()[0]) from None


def load(target: str, device: str = "cpu", dtype: str = "bf16", linear_attention: str = "auto") -> Target:
    """Load the text-only causal LM and its tokenizer; pick the kernels BEFORE the model code loads."""
    if dtype not in DTYPES:
        raise PipelineError(f"--dtype {dtype}: expected one of {sorted(DTYPES)}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise PipelineError(f"--device {device}: not a torch device (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PipelineError(f"--device {device}: CUDA is not available on this machine")
    if dev.type == "cpu":
        torch.set_flush_denormal(True)  # before any parallel region: denormals slow CPU forwards ~100x
    requested = select_linear_attention(dev.type, linear_attention)
    path = resolve(target)
    if not (path / "config.json").is_file():
        raise PipelineError(f"--target {path}: no config.json, so not a Hugging Face model directory")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its "falling back to torch" notice is replaced by what the store records
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    except Exception as e:
        raise PipelineError(f"--target {path}: cannot load it ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    model.to(dev).eval()
    t = Target(model, tokenizer, path, dev, DTYPES[dtype], KernelRecorder(model), requested)
    t.info = describe(t)
    return t


def describe(t: Target) -> dict:
    """Identity of the target: class, sizes, and hashes of config, weights, tensor set, tokenizer."""
    config = t.model.config.to_dict()
    for volatile in ("transformers_version", "_name_or_path", "dtype", "torch_dtype"):
        config.pop(volatile, None)
    weights = {p.name: fingerprint.sha256_file(p) for p in sorted(t.path.iterdir())
               if p.name.endswith(WEIGHT_SUFFIXES)}
    if not weights:
        raise PipelineError(f"--target {t.path}: no *.safetensors or *.bin weight files")
    tensor_set = {k: list(v.shape) for k, v in t.model.state_dict().items()}
    model_class = f"{type(t.model).__module__}.{type(t.model).__qualname__}"
    tok = t.tokenizer
    tok_json = tok.backend_tokenizer.to_str() if hasattr(tok, "backend_tokenizer") else json.dumps(tok.get_vocab(), sort_keys=True)
    return {
        "path": str(t.path),
        "model_class": model_class,
        "model_type": t.model.config.model_type,
        "num_layers": t.num_layers,
        "hidden_size": t.hidden_size,
        "vocab_size": t.model.get_input_embeddings().weight.shape[0],
        "fingerprint": fingerprint.sha256_json({"config": config, "weights": weights, "class": model_class,
                                                 "tensors": tensor_set}),
        "config_sha256": fingerprint.sha256_json(config),
        "weights_sha256": weights,
        "tokenizer_sha256": fingerprint.sha256_json({"tokenizer": tok_json, "special": tok.special_tokens_map}),
        "chat_template_sha256": fingerprint.sha256_text(tok.chat_template or ""),
        "eos_token_ids": t.eos_ids,
        "pad_token_id": t.pad_id,
        "mask_token_id": tok.mask_token_id,
    }
