"""The loaded target: greedy (or sampled) generation, tap capture, and which kernels served them.

`capture` runs ONE forward over prompt+completion and keeps the OUTPUT of decoder layer k for
every tap k (Hugging Face `hidden_states[k+1]`, see taps.py); the forward stops after the last
tap, so later layers, the final norm and lm_head never run. Loading is in loading.py.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

from pipeline.errors import TargetError
from pipeline.sampling import RowSampler
from pipeline.target.capture_batches import capture_batches, chunks
from pipeline.target.chunk_attention import chunk_attention
from pipeline.target.kernels import UNDECIDED, KernelRecorder, interpreted
from pipeline.target.taps import StopForward, tapping
from store.format.schema import Backends, Sampling, TargetRecord

FINAL = "final"  # the key of the final state among a capture's taps (_HostCopy)


class _HostCopy:
    """A tap hook's receiver for one forward: each tap output [b, w, H] (columns lo..lo+w of the
    rows) rounded, cast to bf16 and copied, row by row without the padding, into host[j] [T, H]
    at each row's place (non-blocking into pinned memory on CUDA), then let go."""

    def __init__(
        self, host: list[torch.Tensor], taps: list[int], starts: list[int], lengths: list[int], lo: int, rounding
    ):
        self.host, self.index = host, {k: j for j, k in enumerate(taps)}
        self.starts, self.lengths, self.lo, self.rounding = starts, lengths, lo, rounding

    def __call__(self, k: int, output: torch.Tensor) -> None:
        out = output.to(torch.bfloat16)  # [b, w, H]
        out = out if self.rounding is None else self.rounding(out)
        dest, w = self.host[self.index[k]], out.shape[1]
        for row, (start, length) in enumerate(zip(self.starts, self.lengths)):
            n = min(length - self.lo, w)
            if n > 0:
                dest[start + self.lo : start + self.lo + n].copy_(out[row, :n], non_blocking=dest.is_pinned())


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
        """The decoder's layer list, the one every tap is taken from (`model.layers` of a Llama- or
        Qwen-style decoder); TargetError for a decoder without one (GPT-2's `h`, say)."""
        decoder = self.model.get_decoder()
        layers = getattr(decoder, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            raise TargetError(
                f"{self.path}: its decoder ({type(decoder).__name__}) has no layer list `layers` to tap "
                "(a Llama- or Qwen-style decoder has one)"
            )
        return layers

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
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: list[int],
        on_token=None,
        sampling: Sampling | None = None,
        seeds: list[int] | None = None,
    ) -> list[list[int]]:
        """Greedy completions, batched with left padding; each cut at its first EOS (kept) and limit.
        on_token(k), if given, is called as the batch's k-th completion token is made (progress).
        sampling: sampled instead, each row with its own seed (seeds, one per prompt: pipeline/sampling.py),
        so that a row's completion does not depend on the rows beside it."""
        if not prompts:
            return []
        longest = max(max_new_tokens)
        if longest <= 0:
            return [[] for _ in prompts]
        ids, mask = self._pad(prompts, left=True)
        width = ids.shape[1]
        assert sampling is None or (seeds is not None and len(seeds) == len(prompts)), "a seed per prompt"
        processors = LogitsProcessorList([] if sampling is None else [RowSampler(sampling, seeds, width)])
        # A fresh config: pure argmax (over what RowSampler leaves, when sampling), none of the
        # checkpoint's sampling or repetition settings.
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
                logits_processor=processors,
                streamer=None if on_token is None else _TokenCount(on_token),
            )
        new = out[:, width:].tolist()
        return [cut(seq, self.eos_ids, limit) for seq, limit in zip(new, max_new_tokens)]

    @torch.inference_mode()
    def capture(
        self,
        seqs: list[list[int]],
        taps: list[int],
        prompt_lens: list[int] | None = None,
        *,
        rounding=None,
        budget: int | None = None,
        final_state: bool = False,
    ):
        """Tap outputs for each sequence, concatenated along tokens.

        Returns hidden: [sum(len(s)), n_taps, H] bf16 on CPU, in sequence order. The rows run in
        forwards of at most `budget` token positions each, padding included (capture_batches.py:
        longest first, right-padded, no attention mask; a row longer than the budget in chunks
        through the model's cache, still with no mask: chunk_attention.py); budget None: one
        forward. Each tap output is copied to host
        memory (pinned on CUDA) as its layer returns it, so the device holds no tap beyond the
        layer that made it. The forward stops after the last tap, unless prompt_lens are given:
        then it runs on through the final norm and lm_head along each completion and also returns
        the agreement (matches, tokens): how many completion tokens equal the target's own argmax
        at the position before. rounding: bf16 states -> bf16 states, applied on the target's
        device before the copy to host (the store's fp8 format: store/format/fp8_codec.quantize,
        nearly free on a GPU). final_state: the forward runs on through the final norm and the state
        there, what lm_head consumes (Hugging Face `hidden_states[-1]`), is kept per token too, rounded
        alike: returns (hidden, final: [T, H] bf16 on CPU); not with prompt_lens (the extractor checks
        the stored final state itself: pipeline/target/final_state.py).
        """
        assert not (final_state and prompt_lens is not None)
        lengths = [len(s) for s in seqs]
        starts = [0, *itertools.accumulate(lengths)][:-1]  # each row's first token in the result
        pinned = self.device.type == "cuda"
        host = [
            torch.empty((sum(lengths), self.hidden_size), dtype=torch.bfloat16, pin_memory=pinned)
            for _ in range(len(taps) + final_state)
        ]  # per tap, then the final state: [T, H] bf16
        agreement = [0, 0]
        for batch in capture_batches(lengths, budget):
            rows = [seqs[i] for i in batch.rows]
            ids, _ = self._pad(rows, left=False)  # [b, W]; the padding's states are dropped
            cache = DynamicCache(config=self.model.config) if batch.width > (budget or batch.width) else None
            rows_at, rows_len = [starts[i] for i in batch.rows], [lengths[i] for i in batch.rows]
            with chunk_attention(self.model) if cache is not None else contextlib.nullcontext():
                for lo, hi in chunks(batch.width, budget):
                    take = _HostCopy(host, [*taps, FINAL][: len(host)], rows_at, rows_len, lo, rounding)
                    stop = prompt_lens is None and not final_state
                    last = self._forward(ids[:, lo:hi], taps, take, cache, stop=stop)  # [b, w, H] after the norm
                    if final_state:
                        take(FINAL, last)
                    if prompt_lens is not None:
                        plens = [prompt_lens[i] for i in batch.rows]
                        matches, tokens = self._agreement(last, ids, plens, rows_len, lo)
                        agreement[0] += matches
                        agreement[1] += tokens
        if pinned:
            torch.cuda.synchronize(self.device)  # the copies to host were queued without waiting
        if final_state:
            return torch.stack(host[:-1], dim=1), host[-1]  # [T, n_taps, H], [T, H]
        hidden = torch.stack(host, dim=1)  # [T, n_taps, H]
        return hidden if prompt_lens is None else (hidden, tuple(agreement))

    def final_norm_gain(self) -> torch.Tensor:
        """[H] fp32: the gain of the decoder's final norm, the norm applied to a vector of ones (an RMSNorm's
        gain: (1 + w) for Qwen3.5's x * (1 + w), w for Llama's), for the final state's check
        (pipeline/target/final_state.py)."""
        norm = getattr(self.model.get_decoder(), "norm", None)
        if not isinstance(norm, torch.nn.Module):
            raise TargetError(
                f"{self.path}: its decoder ({type(self.model.get_decoder()).__name__}) has no final norm `norm`, "
                "so the final state cannot be checked; extract without --final-state"
            )
        with torch.inference_mode():
            ones = torch.ones(1, self.hidden_size, dtype=self.dtype, device=self.device)
            return norm(ones)[0].float().cpu()

    def _forward(self, ids: torch.Tensor, taps: list[int], take, cache, stop: bool) -> torch.Tensor | None:
        """ids: [b, w] through the decoder (after the cache's positions, if a cache is given), each
        tap handed to take; returns the last hidden state [b, w, H] unless stopped after the last tap."""
        try:
            with tapping(self.layers, taps, take, stop_after_last=stop), self.recorder.recording():
                out = self.model.get_decoder()(input_ids=ids.to(self.device), cache=cache, use_cache=cache is not None)
        except StopForward:
            return None
        return out.last_hidden_state

    def _agreement(
        self,
        last: torch.Tensor,
        ids: torch.Tensor,
        prompt_lens: list[int],
        lengths: list[int],
        start: int = 0,
        chunk: int = 1024,
    ) -> tuple[int, int]:
        """last: [B, w, H] after the final norm, for columns start..start+w of ids [B, W]. The target's
        greedy token after position t is the argmax of lm_head(last[t]); compare it with each
        completion token. Logits are made a chunk of positions at a time ([chunk, V], not [tokens, V])."""
        end = start + last.shape[1]
        spans = [range(max(p - 1, start), min(n - 1, end)) for p, n in zip(prompt_lens, lengths)]
        rows = [i for i, span in enumerate(spans) for _ in span]
        cols = [t for span in spans for t in span]
        rows_t, cols_t = torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)
        want = ids[rows_t, cols_t + 1]  # [M]
        head = self.model.get_output_embeddings()
        matches = 0
        for lo in range(0, len(rows), chunk):
            r, c = rows_t[lo : lo + chunk].to(last.device), (cols_t[lo : lo + chunk] - start).to(last.device)
            matches += int((head(last[r, c]).argmax(-1).cpu() == want[lo : lo + chunk]).sum())  # last[r, c]: [c, H]
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


def cut(seq: list[int], eos_ids: list[int], limit: int) -> list[int]:
    """A completion up to its first EOS (kept) and at most `limit` tokens: every generator's references
    (this target's, an engine's) are cut alike."""
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
