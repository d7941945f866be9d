"""The loaded target: greedy generation, tap capture, and which kernels served them.

`capture` runs ONE forward over prompt+completion and keeps the OUTPUT of decoder layer k for
every tap k (Hugging Face `hidden_states[k+1]`, see taps.py); the forward stops after the last
tap, so later layers, the final norm and lm_head never run. Loading is in loading.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from pipeline.errors import TargetError
from pipeline.target.kernels import UNDECIDED, KernelRecorder, interpreted
from pipeline.target.taps import StopForward, tapping
from store.format.schema import Backends, TargetRecord


@dataclass
class Target:
    model: torch.nn.Module
    tokenizer: object
    path: Path
    device: torch.device
    dtype: torch.dtype
    recorder: KernelRecorder
    requested_linear_attention: str
    record: TargetRecord  # its identity, as the store records it

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().weight.shape[0]

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
    def generate(self, prompts: list[list[int]], max_new_tokens: list[int], on_token=None) -> list[list[int]]:
        """Greedy completions, batched with left padding; each cut at its first EOS (kept) and limit.
        on_token(k), if given, is called as the batch's k-th completion token is made (progress)."""
        if not prompts:
            return []
        longest = max(max_new_tokens)
        if longest <= 0:
            return [[] for _ in prompts]
        ids, mask = self._pad(prompts, left=True)
        width = ids.shape[1]
        # A fresh config: pure argmax, none of the checkpoint's sampling or repetition settings.
        config = GenerationConfig(
            max_new_tokens=longest,
            do_sample=False,
            num_beams=1,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            use_cache=True,
        )
        with self.recorder.recording():
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                generation_config=config,
                streamer=None if on_token is None else _TokenCount(on_token),
            )
        new = out[:, width:].tolist()
        return [_cut(seq, self.eos_ids, limit) for seq, limit in zip(new, max_new_tokens)]

    @torch.inference_mode()
    def capture(self, seqs: list[list[int]], taps: list[int], prompt_lens: list[int] | None = None, *, rounding=None):
        """Tap outputs for each sequence, concatenated along tokens.

        Returns hidden: [sum(len(s)), n_taps, H] bf16 on CPU, in sequence order. Right padding:
        every real token sees only real tokens before it (causal model). The forward stops after
        the last tap, unless prompt_lens are given: then it runs on through the final norm and
        lm_head along each completion and also returns the agreement (matches, tokens): how many
        completion tokens equal the target's own argmax at the position before. rounding: bf16 states ->
        bf16 states, applied on the target's device before the copy to host (the store's fp8 format:
        store/format/fp8_codec.quantize, nearly free on a GPU).
        """
        ids, mask = self._pad(seqs, left=False)
        grabbed: dict[int, torch.Tensor] = {}
        out = None
        try:
            with tapping(self.layers, taps, grabbed, stop_after_last=prompt_lens is None), self.recorder.recording():
                out = self.model.get_decoder()(
                    input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False
                )
        except StopForward:
            pass
        stacked = torch.stack([grabbed[k] for k in taps], dim=2).to(torch.bfloat16)  # [B, W, n_taps, H]
        hidden = stacked[mask.to(stacked.device).bool()]  # [T, n_taps, H]; row-major = sequence order
        hidden = (hidden if rounding is None else rounding(hidden)).cpu()
        if prompt_lens is None:
            return hidden
        return hidden, self._agreement(out.last_hidden_state, ids, prompt_lens, [len(s) for s in seqs])

    def _agreement(
        self, last: torch.Tensor, ids: torch.Tensor, prompt_lens: list[int], lengths: list[int], chunk: int = 1024
    ) -> tuple[int, int]:
        """last: [B, W, H] after the final norm. The target's greedy token after position t is the
        argmax of lm_head(last[t]); compare it with each completion token. Logits are made a chunk
        of positions at a time ([chunk, V], not [tokens, V])."""
        rows = [i for i, (p, n) in enumerate(zip(prompt_lens, lengths)) for _ in range(p - 1, n - 1)]
        cols = [t for p, n in zip(prompt_lens, lengths) for t in range(p - 1, n - 1)]
        rows_t, cols_t = torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)
        want = ids[rows_t, cols_t + 1]  # [M]
        head = self.model.get_output_embeddings()
        matches = 0
        for lo in range(0, len(rows), chunk):
            h = last[rows_t[lo : lo + chunk].to(last.device), cols_t[lo : lo + chunk].to(last.device)]  # [c, H]
            matches += int((head(h).argmax(-1).cpu() == want[lo : lo + chunk]).sum())
        return matches, len(rows)

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

    def probe(self) -> Backends:
        """A short generate + capture so the recorder sees which kernels serve prefill and decode."""
        ids = self.tokenizer("def probe(x):\n    return", add_special_tokens=False).input_ids
        self.generate([ids], [2])
        self.capture([ids], [0])
        return self.backends()

    def backends(self) -> Backends:
        """The kernels the recorder saw serve every call so far."""
        kernels = self.recorder.summary()
        fla = kernels["linear_attention"] in ("fla", "mixed")
        return Backends(
            linear_attention=kernels["linear_attention"],
            conv1d=kernels["conv1d"],
            linear_attention_requested=self.requested_linear_attention,
            attention=getattr(self.model.config, "_attn_implementation", None),
            kernel_calls=kernels["calls"],
            triton=("interpreter" if interpreted() else "compiled") if fla else None,
        )

    def check_backends(self) -> Backends:
        """What ran must be what was chosen: fla on CUDA when installed, the PyTorch path otherwise;
        and it must be known: a record the code cannot decide stops the run, never a wrong label."""
        b = self.backends()
        ran, wanted = b.linear_attention, self.requested_linear_attention
        version = f"transformers {transformers.__version__}"
        unknown = self._unknown_record(b)
        if unknown:
            raise TargetError(f"{unknown} on {version} (calls: {b.kernel_calls}), so no store can record what ran")
        if ran not in (wanted, "none"):
            raise TargetError(
                f"linear attention ran on '{ran}' but '{wanted}' was chosen for {self.device.type} "
                f"(calls: {b.kernel_calls}): the model code was imported before the kernels were chosen, "
                f"or {version} does not send {self.device.type} tensors to {wanted}"
            )
        return b

    def _unknown_record(self, b: Backends) -> str | None:
        undecided = [
            kind for kind, ran in (("linear-attention", b.linear_attention), ("conv1d", b.conv1d)) if ran == UNDECIDED
        ]
        if undecided:
            return (
                f"cannot tell which implementation served the {' and '.join(undecided)} calls: their dispatch "
                "reached no code known here"
            )
        if b.linear_attention == "none" and "linear_attention" in (
            getattr(self.model.config, "layer_types", None) or ()
        ):
            return "the target has linear-attention layers but none of their calls was seen"
        return None


def _cut(seq: list[int], eos_ids: list[int], limit: int) -> list[int]:
    seq = seq[:limit]
    for i, t in enumerate(seq):
        if t in eos_ids:
            return seq[: i + 1]
    return seq


class _TokenCount(BaseStreamer):
    """Hands generate's step count to a callback: generate puts the prompt first, then each step's
    new tokens (one per row)."""

    def __init__(self, on_token) -> None:
        self.on_token, self.puts = on_token, 0

    def put(self, value) -> None:
        if self.puts:
            self.on_token(self.puts)
        self.puts += 1

    def end(self) -> None:
        pass
