"""The target side of live greedy speculative decoding on a hybrid model, with exact rollback.

One `LiveTarget` holds one sequence's cache. `prefill` runs the prompt; each round `verify` runs
a block [last committed token, drafts...] after everything committed, in ONE forward, and
`commit(n)` keeps the first n block positions. Tap k is the OUTPUT of decoder layer k, taken by
the same hooks as `Target.capture` (taps.py).

Rollback. The cache of a Qwen3.5-style hybrid has two kinds of layers:
- full attention (`DynamicLayer`): keys/values per token, so dropping the rejected tail is a crop
  of the last B - n positions;
- Gated DeltaNet (`LinearAttentionLayer`): a conv state (the last `conv_kernel_size` pre-conv
  q/k/v inputs) and a recurrent state [1, heads, d_k, d_v]. Both are overwritten in place by a
  forward and summarise every token seen, so no slice can take tokens back out.
  (Before 5.25 transformers' `Cache.crop` can roll back the conv state only, and only with past
  recording on; the recurrent state it cannot roll back at all.)

So `verify` first clones every linear-attention state, and records the input each
linear-attention mixer sees for the block. `commit(n < B)` copies the clones back into the cache
(the state right before the block), crops the attention KV, and re-runs only the
linear-attention mixers on their recorded inputs for the first n block positions, which advances
each conv and recurrent state by exactly those n tokens. The recorded inputs are exact for those
positions: the model is causal, so a position's activations do not depend on later positions.
No attention layer, MLP or lm_head runs again. `commit(B)` keeps everything as it is.

Since transformers 5.25 a linear-attention layer also keeps its own token count
(`cumulative_length_linear`: `cache.get_seq_length()` reads it from the first layer, a linear one,
and the model and `generate` take it for the sequence's length). The count is cloned with the states,
copied back with them, and the replay advances it by n as it does the states. Earlier releases keep
no such count. (5.25's own rollback, `activate_past_recording(recurrent_states_to_keep=K)`, keeps K
recurrent states per forward and is not used: the replay is exact on every supported release.)
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin, DynamicLayer, LinearAttentionLayer

from pipeline.errors import TargetError
from pipeline.target.taps import tapping, validate_taps


@dataclass
class _Pending:
    """What `commit` needs from the last `verify`."""

    size: int  # block length B
    saved: dict  # (layer, state_idx) -> (conv, recurrent): linear-attention states before the block
    counts: dict  # layer -> its own token count before the block (transformers >= 5.25; else empty)
    mixer_calls: dict  # layer -> (args, kwargs) of its linear-attention mixer during the block


class LiveTarget:
    """Prefill once, then verify blocks and commit accepted prefixes, for one sequence.

    `length` counts the tokens the cache holds: the prompt plus every committed block position.
    The greedy token returned for the last committed position (the bonus) is not in the cache
    yet; it is the first token of the next block.
    """

    def __init__(self, target, taps: list[int]) -> None:
        validate_taps(list(taps), target.num_layers)
        self.target = target
        self.taps = list(taps)
        self.cache: DynamicCache | None = None
        self._length = 0
        self._pending: _Pending | None = None

    @property
    def length(self) -> int:
        return self._length

    @torch.inference_mode()
    def prefill(self, prompt_ids: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Run the prompt [P] once; return the greedy next token and the tap states [P, n_taps, H]
        (model dtype, CPU). Starts a fresh cache: any earlier sequence is forgotten."""
        prompt_ids = _as_ids(prompt_ids, "prompt")
        self.cache = DynamicCache(config=self.target.model.config)
        _check_layers(self.cache)
        self._length, self._pending = 0, None
        logits, states = self._forward(prompt_ids, logits_to_keep=1)  # logits: [1, V]
        self._length = len(prompt_ids)
        return int(logits[-1].argmax()), states

    @torch.inference_mode()
    def verify(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a block [B] after everything committed so far, in ONE forward pass; return the
        target's greedy next token after each block position [B] (long, CPU) and the tap states
        of the block [B, n_taps, H] (model dtype, CPU). `commit` must follow before the next one."""
        if self.cache is None:
            raise RuntimeError("verify before prefill")
        if self._pending is not None:
            raise RuntimeError("verify twice without commit: commit(n) the previous block first")
        block_ids = _as_ids(block_ids, "block")
        saved, counts = self._save_linear_states(), self._save_counts()
        mixer_calls: dict = {}
        with self._recording_mixers(mixer_calls):
            logits, states = self._forward(block_ids, logits_to_keep=0)  # logits: [B, V]
        self._pending = _Pending(len(block_ids), saved, counts, mixer_calls)
        self._length += len(block_ids)
        return logits.argmax(-1).cpu(), states

    @torch.inference_mode()
    def commit(self, n: int) -> None:
        """Keep only the first n (1..B) positions of the last verified block: the attention KV is
        cropped and the linear-attention conv and recurrent states are rolled back to right after
        the n-th block token. The next verify continues from there."""
        pending = self._pending
        if pending is None:
            raise RuntimeError("commit without a verified block")
        if not 1 <= n <= pending.size:
            raise ValueError(f"commit({n}): expected 1..{pending.size} for a block of {pending.size}")
        self._pending = None
        dropped = pending.size - n
        self._length -= dropped
        if dropped == 0:
            return  # every state already stands right after the last block token
        self._restore_linear_states(pending.saved)
        self._rewind_counts(pending.counts)
        self._crop_attention(dropped)
        self._replay_mixers(pending.mixer_calls, n, pending.size)

    # -- one forward -------------------------------------------------------------------------

    def _forward(self, ids: torch.Tensor, logits_to_keep: int) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [T] at positions length..length+T-1 through the model with the cache.

        Returns logits [T or logits_to_keep, V] (fp32) and tap states [T, n_taps, H] (CPU)."""
        device = self.target.device
        positions = torch.arange(self._length, self._length + len(ids), device=device)[None]  # [1, T]
        grabbed: dict[int, torch.Tensor] = {}
        with tapping(self.target.layers, self.taps, grabbed.__setitem__):
            out = self.target.model(
                input_ids=ids.to(device)[None],
                position_ids=positions,
                cache=self.cache,
                use_cache=True,
                logits_to_keep=logits_to_keep,
            )
        states = torch.stack([grabbed[k][0] for k in self.taps], dim=1)  # [T, n_taps, H]
        return out.logits[0].float(), states.cpu()

    @contextmanager
    def _recording_mixers(self, calls: dict):
        """Pre-hooks that keep each linear-attention mixer's call: calls[i] = (args, kwargs)."""

        def hook_for(i: int):
            def hook(_module, args, kwargs):
                calls[i] = (args, kwargs)

            return hook

        handles = [
            _mixer(self.target.layers[i]).register_forward_pre_hook(hook_for(i), with_kwargs=True)
            for i in self._linear_layers()
        ]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    # -- rollback ----------------------------------------------------------------------------

    def _linear_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.cache.layers) if isinstance(layer, LinearAttentionLayer)]

    def _save_linear_states(self) -> dict:
        """Clones of every linear-attention state: (layer, state_idx) -> (conv, recurrent)."""
        saved = {}
        for i in self._linear_layers():
            for s in range(self.cache.layers[i].number_of_states):
                conv, rec = self.cache.get_conv_state(i, s), self.cache.get_recurrent_state(i, s)
                if conv is None or rec is None:
                    raise TargetError(f"layer {i}: no linear-attention state after prefill")
                saved[i, s] = (conv.clone(), rec.clone())  # conv: [1, C, K]; rec: [1, heads, d_k, d_v]
        return saved

    def _restore_linear_states(self, saved: dict) -> None:
        """Copy the clones back in place (the cache keeps its tensors: in-place updates, static addresses)."""
        for (i, s), (conv, rec) in saved.items():
            self.cache.get_conv_state(i, s).copy_(conv)
            self.cache.get_recurrent_state(i, s).copy_(rec)

    def _save_counts(self) -> dict:
        """layer -> a clone of its own token count, for the linear layers that keep one (transformers >= 5.25)."""
        return {
            i: count.clone() for i in self._linear_layers() if (count := _own_count(self.cache.layers[i])) is not None
        }

    def _rewind_counts(self, counts: dict) -> None:
        """Copy the counts back in place, to before the block; the replay then advances them by n."""
        for i, count in counts.items():
            _own_count(self.cache.layers[i]).copy_(count)

    def _crop_attention(self, dropped: int) -> None:
        """Drop the last `dropped` keys/values of every attention layer.

        Per layer: `Cache.crop` would also crop the linear layers, which raises without past
        recording. `DynamicLayer.crop` takes the NEGATIVE count of tokens to remove."""
        for layer in self.cache.layers:
            if isinstance(layer, DynamicLayer):
                layer.crop(-dropped)

    def _replay_mixers(self, calls: dict, n: int, size: int) -> None:
        """Re-run each linear-attention mixer on its recorded input for the first n of `size` block
        positions; the mixer advances its conv and recurrent state in the cache as it goes."""
        for i in self._linear_layers():
            args, kwargs = calls[i]
            args = tuple(_head(a, n, size) for a in args)
            kwargs = {k: _head(v, n, size) for k, v in kwargs.items()}
            _mixer(self.target.layers[i])(*args, **kwargs)


def _head(value, n: int, size: int):
    """The first n positions of a per-position tensor ([1, B, ...]: hidden states, padding mask);
    anything else (the cache, flags) unchanged."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == size:
        return value[:, :n]
    return value


def _own_count(layer) -> torch.Tensor | None:
    """The token count a linear-attention cache layer keeps itself (a 0-d tensor, transformers >= 5.25),
    or None where the release keeps none."""
    count = getattr(layer, "cumulative_length_linear", None)
    assert count is None or isinstance(count, torch.Tensor), type(count)
    return count


def _mixer(layer: torch.nn.Module) -> torch.nn.Module:
    mixer = getattr(layer, "linear_attn", None)
    if mixer is None:
        raise TargetError(f"{type(layer).__name__}: no `linear_attn` module for its linear-attention cache layer")
    return mixer


def _check_layers(cache: DynamicCache) -> None:
    """Only cache layers whose rollback is implemented: full-attention KV and linear attention."""
    for i, layer in enumerate(cache.layers):
        plain_kv = type(layer) is DynamicLayer
        linear = isinstance(layer, LinearAttentionLayer) and not isinstance(layer, CacheLayerMixin)
        if not (plain_kv or linear):
            raise TargetError(
                f"cache layer {i} is {type(layer).__name__}: live rollback supports full attention "
                "and linear attention layers only"
            )


def _as_ids(ids: torch.Tensor, what: str) -> torch.Tensor:
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() != 1 or len(ids) == 0:
        raise ValueError(f"{what} ids: expected a non-empty 1-D tensor, got shape {tuple(ids.shape)}")
    return ids
