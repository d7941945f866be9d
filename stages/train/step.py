"""One micro-batch's loss: anchors, blocks, the attention masks, the drafter forward and the DFlash
loss. What it needs besides the batch is resolved once at setup into a `LossPlan`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.drafter import masks
from pipeline.drafter.blocks import before_slots, make_blocks, sample_anchors
from pipeline.drafter.config import DrafterConfig
from pipeline.drafter.dspark_loss import dspark_loss
from pipeline.drafter.loss import GPU_LOGITS_BYTES, LOGITS_BYTES, LossOut, dflash_loss, rows_within
from pipeline.drafter.model import Drafter
from stages.train.config import LossConfig
from stages.train.recipe import slot_gamma
from store.errors import ConfigError

CTX_BUCKET = 512  # flex (CUDA): context lengths are rounded up to this


@dataclass(frozen=True)
class LossPlan:
    """The per-step constants of a run."""

    anchors: int  # blocks per document
    block_size: int
    mask_token_id: int
    gamma: float | None  # exp slot weights' decay; None with D-PACE
    noise_std: float  # on fc's input only: the Gaussian's sd, or the uniform's half-width
    flex: bool  # flex_attention (CUDA) or block-local SDPA (CPU)
    dpace_alpha: float | None = None  # D-PACE slot weights' smoothing; None: exp weights
    anchor_budget: int | None = None  # blocks per micro-batch in all; None: no limit
    anchor_rule: str = "pair"  # drafter config's ANCHOR_RULES
    loss_norm: str = "weights"  # drafter config's NORMS
    noise: str = "gaussian"  # recipe.NOISES
    packed: bool = False  # --batching packed: rows hold several documents (batch.starts is read)
    acceptance: float = 0.0  # the expected-acceptance term's weight (loss.dflash_loss); 0: CE alone
    soft: str = "none"  # drafter config's SOFT_TARGETS: the batches then carry the final states
    soft_weight: float = 0.5

    @classmethod
    def of(cls, config: LossConfig, drafter: DrafterConfig, flex: bool, packed: bool = False) -> LossPlan:
        """From the loss's settings and the drafter's config (an --init-from checkpoint's block size);
        packed: --batching packed."""
        gamma = slot_gamma(config, drafter.block_size)
        if drafter.head == "dspark" and config.acceptance_weight:
            raise ConfigError(
                "--acceptance-weight", config.acceptance_weight, "is not used with --head dspark (its own TV + CE mix)"
            )
        if drafter.head == "dspark" and config.soft_targets not in ("none", "tv"):
            raise ConfigError(
                "--soft-targets", config.soft_targets, "a dspark drafter takes tv (the TV share of its 0.9 TV + 0.1 CE)"
            )
        alpha = None if config.slot_weights == "exp" else config.dpace_alpha
        return cls(
            config.anchors,
            drafter.block_size,
            drafter.mask_token_id,
            gamma,
            config.noise_std,
            flex,
            alpha,
            config.anchor_budget,
            config.anchor_rule,
            config.loss_norm,
            config.noise,
            packed,
            config.acceptance_weight,
            config.soft_targets,
            config.soft_weight,
        )

    @property
    def width(self) -> int:
        """The most blocks a row can get."""
        return min(self.anchors, self.anchor_budget or self.anchors)


def step_generator(seed: int, step: int, micro: int, rank: int, device: torch.device) -> torch.Generator:
    """Anchors and noise depend only on (seed, step, micro-batch, rank): resume-exact."""
    g = torch.Generator(device=device)
    g.manual_seed(((seed * 1_000_003 + step) * 1009 + micro) * 101 + rank)
    return g


def forward_loss(model, raw: Drafter, batch, plan: LossPlan, gen: torch.Generator, host=None) -> LossOut:
    """One micro-batch -> LossOut. model: as prepared (DDP wrapper); raw: the Drafter inside it;
    batch tensors are on the model's device; host: the same batch in host memory, if the caller has
    it (the anchors are drawn on the host from it: no read back from the device, no wait)."""
    starts = batch.starts if plan.packed else None  # [b, T] packed rows; None: one document per row
    on_host = host if host is not None else batch
    anchors, valid = sample_anchors(
        on_host.loss_mask.cpu(),  # [b, T] bool
        plan.anchors,
        generator=_cpu(gen),
        budget=plan.anchor_budget,
        starts=None if starts is None else on_host.starts.cpu(),
        rule=plan.anchor_rule,
    )
    ctx_len = int(anchors.max())  # keys at or past the last anchor are never visible (strict <)
    if plan.flex:  # few distinct shapes, so the compiled kernel is not rebuilt for every batch
        anchors, valid, ctx_len = pad_for_compile(anchors, valid, ctx_len, plan.width)
    anchors, valid = anchors.to(batch.tokens.device), valid.to(batch.tokens.device)
    blocks = make_blocks(batch.tokens, batch.loss_mask, anchors, valid, plan.block_size, plan.mask_token_id, starts)
    hidden = batch.hidden[:, :ctx_len]  # [b, S, n_taps, H] bf16
    if hidden.shape[1] < ctx_len:  # padded keys: zeros, never visible (kv < anchor <= length)
        hidden = torch.nn.functional.pad(hidden, (0, 0, 0, 0, 0, ctx_len - hidden.shape[1]))
    ctx_pos = context_positions(batch.starts, ctx_len)  # [b, S]: restarting at each document
    noise = make_noise(plan, hidden.shape, gen, hidden.device) if plan.noise_std > 0 and model.training else None
    mask = masks.build(
        raw.rules,
        anchors,
        valid,
        ctx_len,
        plan.block_size,
        "flex" if plan.flex else "local",
        None if starts is None else blocks.starts,
    )
    h = model(hidden, blocks.block_ids, ctx_pos, blocks.positions, mask, noise)
    # the slot weighting and chunking both objectives share
    weighting = dict(
        dpace=plan.dpace_alpha, chunk_rows=loss_chunk_rows(raw.lm_head.shape[0], h.device), norm=plan.loss_norm
    )
    # the final state that predicted each slot's token: [b, N, B, H] bf16 (soft targets' p)
    target = None if plan.soft == "none" else before_slots(batch.final, anchors, plan.block_size)
    if raw.config.head == "dspark":
        previous = before_slots(batch.tokens, anchors, plan.block_size)  # [b, N, B]
        heads = (raw.lm_head, raw.markov_head, raw.confidence_head)
        return dspark_loss(h, blocks.labels, previous, *heads, plan.gamma, target=target, **weighting)
    soft = dict(soft=plan.soft, soft_weight=plan.soft_weight, target=target)
    return dflash_loss(h, blocks.labels, raw.lm_head, plan.gamma, acceptance=plan.acceptance, **weighting, **soft)


def loss_chunk_rows(vocab: int, device: torch.device) -> int:
    """Logits rows per chunk of the fused loss: GPU_LOGITS_BYTES of fp32 logits on a GPU, LOGITS_BYTES
    elsewhere (the arithmetic at GPU_LOGITS_BYTES)."""
    return rows_within(vocab, GPU_LOGITS_BYTES if device.type == "cuda" else LOGITS_BYTES)


def make_noise(plan: LossPlan, shape, gen: torch.Generator, device) -> torch.Tensor:
    """Noise for fc's input: Gaussian with sd noise_std, or uniform in [-noise_std, noise_std]
    (speculators' AddUniformNoise)."""
    if plan.noise == "uniform":
        return (torch.rand(shape, generator=gen, device=device) * 2 - 1) * plan.noise_std
    return torch.randn(shape, generator=gen, device=device) * plan.noise_std


def context_positions(starts: torch.Tensor, ctx_len: int) -> torch.Tensor:
    """starts: [b, T] document starts -> [b, ctx_len] positions within each token's document
    (padded keys past T continue the count; they are never visible)."""
    b, T = starts.shape
    pos = torch.arange(ctx_len, device=starts.device)[None].expand(b, -1)
    n = min(T, ctx_len)
    return torch.cat([pos[:, :n] - starts[:, :n], pos[:, n:]], dim=1)


def pad_for_compile(anchors, valid, ctx_len: int, n: int, multiple: int = CTX_BUCKET):
    """Anchors padded (invalid) to a multiple of n (n itself unless a packed row holds more), the
    context length rounded up to a multiple."""
    pad = -(-anchors.shape[1] // n) * n - anchors.shape[1]
    if pad > 0:
        anchors = torch.nn.functional.pad(anchors, (0, pad))
        valid = torch.nn.functional.pad(valid, (0, pad))
    return anchors, valid, -(-max(ctx_len, 1) // multiple) * multiple


def _cpu(gen: torch.Generator) -> torch.Generator:
    if gen.device.type == "cpu":
        return gen
    g = torch.Generator()
    g.manual_seed(gen.initial_seed())
    return g
