"""The DFlash drafter (SPEC §2): fc over all taps, hidden_norm, Qwen3 layers with the context as
extra keys/values, final norm, then the target's frozen lm_head.

Parameter names are the released drafters' (`fc.weight`, `layers.N.self_attn.q_proj.weight`,
...); the target's embedding and lm_head are non-persistent buffers, so they are never saved,
never optimized and never synchronized.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.drafter.attention import attend
from pipeline.drafter.config import DrafterConfig
from pipeline.drafter.dspark import ConfidenceHead, MarkovHead, sequential_drafts
from pipeline.drafter.masks import LayerRule

HEAD_MODULES = ("markov_head.", "confidence_head.")  # the dspark head's parameters (dspark.py)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """cos/sin per position; rotates the first `dim` channels of each head (partial rotary)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        rope = dict(config.rope_parameters)
        kind = rope.get("rope_type", "default")
        if kind == "default":
            dim = int(config.head_dim * float(rope.get("partial_rotary_factor", 1.0)))
            inv_freq = 1.0 / (float(rope["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        else:  # scaled variants: transformers' own initializers read the same fields
            from transformers import Qwen3Config
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            hf = Qwen3Config(
                hidden_size=config.hidden_size,
                num_attention_heads=config.num_attention_heads,
                head_dim=config.head_dim,
                max_position_embeddings=config.max_position_embeddings,
                rope_parameters=rope,
            )
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](hf, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scaling = float(scaling)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [b, L] long -> cos, sin: [b, 1, L, rot_dim] fp32
        freqs = positions[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos() * self.scaling, emb.sin() * self.scaling


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, L, head_dim]; rotates x[..., :rot_dim] (rotate-half convention)."""
    r = cos.shape[-1]
    rot, keep = x[..., :r], x[..., r:]
    half = r // 2
    turned = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    rot = (rot.float() * cos + turned.float() * sin).to(x.dtype)
    return torch.cat((rot, keep), dim=-1) if keep.shape[-1] else rot


class Attention(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)

    def project_kv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [b, L, H] -> k, v: [b, kv_heads, L, head_dim], k normed and rotated."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(k, cos, sin), v

    def forward(self, x, kv_ctx, rope_blk, mask) -> torch.Tensor:
        # x: [b, Q, H] block stream; kv_ctx: this layer's (k, v) of the context, [b, kv_heads, S, head_dim]
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rotary(q, *rope_blk)
        k_ctx, v_ctx = kv_ctx
        k_blk, v_blk = self.project_kv(x, *rope_blk)
        out = attend(q, k_ctx, v_ctx, k_blk, v_blk, mask, self.head_dim**-0.5)  # [b, heads, Q, head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: DrafterConfig, i: int) -> None:
        super().__init__()
        self.rule = LayerRule(*c.layer_rule(i))
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, kv_ctx, rope_blk, masks: dict) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), kv_ctx, rope_blk, masks[self.rule])
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    """embed_tokens, lm_head: the target's [V, H] tensors. The drafter keeps the given tensors as
    they are (no copy; at 27B each is 2.5 GB in bf16): they are frozen buffers that nothing writes to,
    so callers hand over tensors already on the right device and in the right dtype, and several
    drafters may share one pair."""

    def __init__(self, config: DrafterConfig, embed_tokens: torch.Tensor, lm_head: torch.Tensor) -> None:
        super().__init__()
        c = self.config = config
        for name, w in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            if tuple(w.shape) != (c.vocab_size, c.hidden_size):
                raise ValueError(
                    f"target {name} is {tuple(w.shape)}, the drafter needs ({c.vocab_size}, {c.hidden_size})"
                )
        self.fc = nn.Linear(c.num_taps * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = Rotary(c)
        if c.head == "dspark":  # vLLM's names: markov_head.markov_w1/w2, confidence_head.proj
            self.markov_head = MarkovHead(c)
            self.confidence_head = ConfidenceHead(c)
        # Frozen target tensors: [V, H], never saved (non-persistent), never trained, never copied.
        self.register_buffer("embed_tokens", embed_tokens.detach(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach(), persistent=False)
        # Training at long context (--grad-checkpoint): each layer's activations are recomputed in the
        # backward pass instead of kept; the same numbers, less memory, about one more forward of the layers.
        self.checkpoint_layers = False

    @property
    def rules(self) -> list[LayerRule]:
        return [layer.rule for layer in self.layers]

    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        """Normal(0, std) linears, unit norms (Qwen3's initializer); reproducible with a generator. The
        dspark heads come after the backbone (whose draws are then a DFlash drafter's of the same seed):
        markov_w2 and the confidence bias start at zero, so the head starts as no bias at all."""
        params = sorted(self.named_parameters())
        backbone = [(n, p) for n, p in params if not n.startswith(HEAD_MODULES)]
        heads = [(n, p) for n, p in params if n.startswith(HEAD_MODULES)]
        for name, p in backbone + heads:
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name in ("markov_head.markov_w2.weight", "confidence_head.proj.bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=generator) * std)

    def context(self, hidden: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [b, S, n_taps, H] target states -> ctx [b, S, H]. noise (same shape) touches fc's
        input only."""
        x = hidden.flatten(2).to(self.fc.weight.dtype)
        if noise is not None:
            x = x + noise.flatten(2).to(x.dtype)
        return self.hidden_norm(self.fc(x))

    def embed(self, block_ids: torch.Tensor) -> torch.Tensor:
        # block_ids: [b, Q] -> [b, Q, H] in the parameters' dtype (fp32 master weights)
        return F.embedding(block_ids, self.embed_tokens).to(self.fc.weight.dtype) * self.config.input_embedding_scale

    def forward(self, hidden, block_ids, ctx_positions, block_positions, masks: dict, noise=None) -> torch.Tensor:
        """hidden: [b, S, n_taps, H]; block_ids, block_positions: [b, Q]; ctx_positions: [b, S].
        Returns the normed block stream [b, Q, H] (logits: `self.logits`)."""
        return self.run_block(
            self.context_kv(self.context(hidden, noise), ctx_positions), block_ids, block_positions, masks
        )

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """ctx: [b, S, H] -> per layer (k, v): [b, kv_heads, S, head_dim], k normed and rotated. The
        same ctx enters every layer; inference caches these and appends as the context grows."""
        rope = self.rotary(positions)
        return [layer.self_attn.project_kv(ctx, *rope) for layer in self.layers]

    def run_block(self, kv_ctx: list, block_ids, block_positions, masks: dict) -> torch.Tensor:
        """The block stream through every layer, attending to the given context K/V -> [b, Q, H] normed."""
        x = self.embed(block_ids)
        rope_blk = self.rotary(block_positions)
        recompute = self.checkpoint_layers and torch.is_grad_enabled()
        for layer, kv in zip(self.layers, kv_ctx):
            x = (
                checkpoint(layer, x, kv, rope_blk, masks, use_reentrant=False)
                if recompute
                else layer(x, kv, rope_blk, masks)
            )
        return self.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        # h: [..., H] -> [..., V] (under autocast both run in bf16)
        return F.linear(h.to(self.lm_head.dtype), self.lm_head)

    def chain_drafts(self, h: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """Greedy chain drafts: h [n, D, H] slots 1..B-1 of n blocks, first [n] long their anchors ->
        [n, D] long (drafts_of their logits)."""
        return self.drafts_of(self.logits(h), first)

    def drafts_of(self, logits: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """Greedy chain drafts from the backbone's logits [n, D, V] and the anchors [n] -> [n, D] long.
        DFlash: each slot's argmax; dspark: sequential with the transition bias."""
        if self.config.head == "dspark":
            return sequential_drafts(logits, first, self.markov_head)
        return logits.argmax(-1)
