"""DFlash drafter for `AutoModel.from_pretrained(DIR, trust_remote_code=True)`.

Written by dflash-pipeline, which copies this file into every drafter checkpoint it writes
(config.json: `"auto_map": {"AutoModel": "modeling_dflash.DFlashDraftModel"}`). It imports only
torch and transformers, and runs on transformers 4.5x and 5.x.

Forward contract (that of the reference DFlashDraftModel):
  target_hidden    [b, S, n_taps*H]  the target's tap-layer outputs (Hugging Face
                                     hidden_states[k+1] for tap k), concatenated in target_layer_ids order
  noise_embedding  [b, Q, H]         the target's input embedding of [anchor, mask_token_id x (Q-1)]
  position_ids     [b, S+Q]          context positions, then block positions
  returns          [b, Q, H]         final-normed states; logits = the target's lm_head of them.
noise_embedding is scaled by dflash_config.input_embedding_scale when a checkpoint sets it (default 1).
The context K/V are projected from ctx = hidden_norm(fc(target_hidden)) itself in every layer; the
block stream goes through input_layernorm before its Q/K/V.

Attention rule of layer i: causal = (layer_types[i] == "sliding_attention"), or config.is_causal for
every layer when that is set; window = sliding_window for sliding layers, else none. Every given
context key is visible (in inference the context is exactly the positions before the anchor); a
causal layer sees block keys with k_pos <= q_pos; with a window, context and block keys alike only
when q_pos - k_pos < window (and k_pos - q_pos < window when not causal). The mask is built from
position_ids unless attention_mask ([b, 1, Q, S+Q], bool True = attend, or additive) is given.

Its norm and rotary code restate pipeline/drafter/model.py's on purpose: this file must run where
dflash-pipeline is not installed. tests/pipeline/drafter/test_modeling_dflash.py holds the two
drafters' logits bit for bit equal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config


class DFlashRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_settings(config) -> dict:
    """rope_parameters (transformers 5, or carried verbatim by 4.x) or the v4 fields."""
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and rope:
        rope = dict(rope)
    else:
        rope = dict(getattr(config, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
        if getattr(config, "partial_rotary_factor", None) is not None:
            rope.setdefault("partial_rotary_factor", config.partial_rotary_factor)
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def inv_frequencies(config) -> tuple[torch.Tensor, float]:
    """(inv_freq [rot_dim/2] fp32 on CPU, attention scaling)."""
    rope = rope_settings(config)
    kind = rope["rope_type"]
    if kind == "default":
        dim = int(config.head_dim * float(rope.get("partial_rotary_factor", 1.0)))
        return 1.0 / (float(rope["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, None)
    return inv_freq.float().cpu(), float(scaling)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, L, head_dim]; cos, sin: [b, 1, L, rot_dim] fp32. Rotates x[..., :rot_dim] (rotate-half)."""
    r = cos.shape[-1]
    rot, keep = x[..., :r], x[..., r:]
    half = r // 2
    turned = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    rot = (rot.float() * cos + turned.float() * sin).to(x.dtype)
    return torch.cat((rot, keep), dim=-1) if keep.shape[-1] else rot


class DFlashAttention(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)
        self.q_norm = DFlashRMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, c.rms_norm_eps)

    def heads_of(self, x: torch.Tensor, proj: nn.Linear, n: int) -> torch.Tensor:
        # x: [b, L, H] -> [b, n, L, head_dim]
        return proj(x).view(x.shape[0], x.shape[1], n, self.head_dim).transpose(1, 2)

    def forward(self, x, ctx, rope_ctx, rope_blk, mask) -> torch.Tensor:
        # x: [b, Q, H] normed block stream; ctx: [b, S, H]; mask: [b, 1, Q, S+Q] bool or additive
        q = apply_rotary(self.q_norm(self.heads_of(x, self.q_proj, self.heads)), *rope_blk)  # [b, heads, Q, d]
        ks, vs = [], []
        for src, rope in ((ctx, rope_ctx), (x, rope_blk)):  # keys and values of [context ; block]
            ks.append(apply_rotary(self.k_norm(self.heads_of(src, self.k_proj, self.kv_heads)), *rope))
            vs.append(self.heads_of(src, self.v_proj, self.kv_heads))
        rep = self.heads // self.kv_heads
        k = torch.cat(ks, dim=2).repeat_interleave(rep, dim=1)  # [b, heads, S+Q, head_dim]
        v = torch.cat(vs, dim=2).repeat_interleave(rep, dim=1)
        if mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))  # [b, Q, H]


class DFlashMLP(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, c, i: int) -> None:
        super().__init__()
        sliding = c.layer_types[i] == "sliding_attention"
        is_causal = getattr(c, "is_causal", None)
        self.causal = sliding if is_causal is None else bool(is_causal)
        self.window = c.sliding_window if sliding else None
        if sliding and not self.window:
            raise ValueError(
                f"layer {i} is sliding_attention but the config has no sliding_window "
                "(Qwen3Config keeps it only with use_sliding_window: true)"
            )
        self.input_layernorm = DFlashRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DFlashAttention(c)
        self.post_attention_layernorm = DFlashRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = DFlashMLP(c)

    def mask(self, positions: torch.Tensor, ctx_len: int) -> torch.Tensor:
        """positions: [b, S+Q] -> [b, 1, Q, S+Q] bool, True = may attend."""
        q_pos = positions[:, ctx_len:, None]  # [b, Q, 1]
        k_pos = positions[:, None, :]  # [b, 1, S+Q]
        in_block = torch.arange(positions.shape[1], device=positions.device) >= ctx_len
        ok = torch.ones(q_pos.shape[0], q_pos.shape[1], k_pos.shape[2], dtype=torch.bool, device=positions.device)
        if self.causal:
            ok = ok & (~in_block | (k_pos <= q_pos))
        if self.window is not None:
            ok = ok & (q_pos - k_pos < self.window)
            if not self.causal:
                ok = ok & (k_pos - q_pos < self.window)
        return ok[:, None]

    def forward(self, x, ctx, rope_ctx, rope_blk, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_ctx, rope_blk, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = ""

    def __init__(self, config) -> None:
        super().__init__(config)
        dflash = getattr(config, "dflash_config", None) or {}
        self.target_layer_ids = list(dflash.get("target_layer_ids") or [])
        if not self.target_layer_ids:
            raise ValueError("config.dflash_config.target_layer_ids is missing")
        self.block_size = int(dflash.get("block_size") or getattr(config, "block_size", None) or 16)
        self.mask_token_id = int(dflash["mask_token_id"])
        self.input_embedding_scale = float(dflash.get("input_embedding_scale", 1.0))
        H = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.post_init()

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [b, L] -> cos, sin: [b, 1, L, rot_dim] fp32 (recomputed: no buffer to initialise)
        inv_freq, scaling = inv_frequencies(self.config)
        freqs = positions[..., None].float() * inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos() * scaling, emb.sin() * scaling

    def forward(
        self,
        position_ids,
        attention_mask=None,
        noise_embedding=None,
        target_hidden=None,
        past_key_values=None,
        use_cache=False,
        **kwargs,
    ) -> torch.Tensor:
        if past_key_values is not None:
            raise NotImplementedError("DFlashDraftModel (dflash-pipeline) has no KV cache: pass the whole context")
        dtype = self.fc.weight.dtype
        ctx = self.hidden_norm(self.fc(target_hidden.to(dtype)))  # [b, S, H]
        x = noise_embedding.to(dtype) * self.input_embedding_scale  # [b, Q, H]
        S = ctx.shape[1]
        rope_ctx, rope_blk = self.rope(position_ids[:, :S]), self.rope(position_ids[:, S:])
        for layer in self.layers:
            mask = attention_mask if attention_mask is not None else layer.mask(position_ids, S)
            x = layer(x, ctx, rope_ctx, rope_blk, mask)
        return self.norm(x)  # [b, Q, H]

    @torch.no_grad()
    def spec_generate(self, target, input_ids, max_new_tokens, stop_token_ids=None, temperature=0.0):
        """Greedy DFlash speculative decoding with a Hugging Face causal LM target (batch 1, no
        cache: the target reruns the whole sequence each round). Returns [1, prompt + new] ids,
        exactly the target's greedy output; self.spec_stats["accepted"] holds drafts accepted per round."""
        if temperature > 0:
            raise NotImplementedError("spec_generate is greedy only (temperature 0)")
        if input_ids.shape[0] != 1:
            raise NotImplementedError("spec_generate takes one sequence (batch 1)")
        stops = set(stop_token_ids or [])
        ids, prompt_len, accepted = input_ids, input_ids.shape[1], []
        states = self.tap_states(target(ids, output_hidden_states=True, use_cache=False))  # [1, n, T*H]
        while ids.shape[1] - prompt_len < max_new_tokens:
            drafts = self.draft(target, ids, states[:, : ids.shape[1] - 1])  # [1, B-1]
            out = target(torch.cat((ids, drafts), dim=1), output_hidden_states=True, use_cache=False)
            greedy = out.logits[:, ids.shape[1] - 1 :].argmax(-1)  # [1, B]: the target's token after each prefix
            k = int((drafts == greedy[:, :-1]).long().cumprod(-1).sum())
            accepted.append(k)
            new = greedy[0, : k + 1].tolist()[: max_new_tokens - (ids.shape[1] - prompt_len)]
            hit = [i for i, t in enumerate(new) if t in stops]
            new = new[: hit[0] + 1] if hit else new
            states = self.tap_states(out)  # positions of ids + accepted drafts are the committed ones
            ids = torch.cat((ids, torch.tensor([new], dtype=ids.dtype, device=ids.device)), dim=1)
            if hit:
                break
        self.spec_stats = {"rounds": len(accepted), "accepted": accepted}
        return ids

    def tap_states(self, out) -> torch.Tensor:
        # hidden_states[k+1] is the output of target layer k -> [1, L, n_taps*H]
        return torch.cat([out.hidden_states[k + 1] for k in self.target_layer_ids], dim=-1)

    def draft(self, target, ids: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """ids: [1, n]; context: [1, n-1, T*H] (states before the anchor ids[-1]) -> drafts [1, B-1]."""
        n, B = ids.shape[1], self.block_size
        block = torch.full((1, B), self.mask_token_id, dtype=ids.dtype, device=ids.device)
        block[0, 0] = ids[0, -1]
        positions = torch.arange(n - 1 + B, device=ids.device)[None]  # context 0..n-2, block n-1..n+B-2
        hidden = self(positions, noise_embedding=target.get_input_embeddings()(block), target_hidden=context)
        head = target.get_output_embeddings()
        return head(hidden[:, 1:].to(head.weight.dtype)).argmax(-1)
