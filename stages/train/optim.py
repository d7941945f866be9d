"""The optimizers and the learning-rate schedule of a training run.

adamw: one AdamW over every trainable parameter. muon: Muon over the 2-D weight matrices (every
Linear of the drafter; `fc` included) and AdamW over the rest (the norms), as speculators trains
DFlash drafters; Muon's rate is --muon-lr (10 x --lr unless given), scaled to match AdamW's update
size (adjust_lr_fn "match_rms_adamw"). Each optimizer gets its own copy of the one schedule: linear
warmup over --warmup-ratio of the steps, then cosine or linear decay to 0.

Muon is torch.optim.Muon with one change: the Newton-Schulz iteration runs in bf16 (torch's
choice) only on CUDA, and in fp32 elsewhere. A CPU without native bf16 matmuls emulates them: on
the 2-core development machine (loaded) the tiny target's drafter (1.2M parameters) took 1.95 s a
Muon step in bf16, 0.13 s in fp32, against AdamW's 0.014 s and a training step of about 1.4 s. In
bf16 the update equals torch's bit for bit (tests/stages/test_optim.py); the state is torch's
(`momentum_buffer`), so checkpoints hold the same tensors.

The iteration is split over the run's processes (Muon.step). At 27B width it costs about 197
TFLOP per optimizer step (5 iterations over fc, 20 attention and 15 MLP matrices; an MLP matrix
alone 10.5), against about 144 TFLOP for one 4,096-token sequence's forward and backward: done
whole on every rank it would more than double a --batch-size 1 step, split over 8 ranks it adds
about 25 TFLOP per rank, plus a broadcast of the updates (3.5 GB in bf16 per step, received by each).
"""

from __future__ import annotations

import math

import torch

from stages.train.config import OptimConfig


def muon_split(model: torch.nn.Module) -> tuple[list, list]:
    """(the 2-D matrices with both sides > 1, everything else) among the trainable parameters,
    in named_parameters order."""
    matrices, rest = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (matrices if p.ndim == 2 and min(p.shape) > 1 else rest).append(p)
    return matrices, rest


class Muon(torch.optim.Muon):
    """torch.optim.Muon, its Newton-Schulz iteration in ns_dtype (the module doc says why), and split
    over the processes of a run: the gradients are the same on every rank after DDP's all-reduce,
    so each rank orthogonalizes its own share of the matrices (`owners`) and broadcasts the results;
    every rank then applies every update, as when each computed them all (the same values)."""

    def __init__(self, params, *, ns_dtype: torch.dtype, **kw) -> None:
        super().__init__(params, **kw)
        self.ns_dtype = ns_dtype
        self.broadcast_bytes = 0  # updates broadcast so far (each rank sends its share, receives the rest)

    @torch.no_grad()
    def step(self, closure=None):
        """torch's _single_tensor_muon, step for step, with `orthogonalized` in ns_dtype."""
        assert closure is None, "Muon here takes no closure"
        todo = []  # (param, its group, the momentum-corrected gradient)
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            for p, grad, buf in zip(params, grads, bufs):
                buf.lerp_(grad, 1 - group["momentum"])
                todo.append((p, group, grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf))
        rank, world = _process()
        mine = owners([p.shape for p, _, _ in todo], world)
        updates = []
        for (p, group, g), owner in zip(todo, mine):
            if owner == rank:
                u = orthogonalized(g, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
            else:
                u = torch.empty(p.shape, dtype=self.ns_dtype, device=p.device)
            updates.append(u.contiguous())
        if world > 1:
            for u, owner in zip(updates, mine):
                torch.distributed.broadcast(u, src=owner)
            self.broadcast_bytes += sum(u.numel() * u.element_size() for u in updates)
        for (p, group, _), u in zip(todo, updates):
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(u, alpha=-group["lr"] * rms_ratio(group["adjust_lr_fn"], p.shape))


def _process() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def owners(shapes: list, world: int) -> list[int]:
    """The rank that orthogonalizes each matrix: largest first, each to the least loaded rank, by the
    iteration's cost (A * B * min(A, B)); the same on every rank."""
    load, out = [0] * world, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-math.prod(shapes[i]) * min(shapes[i]), i)):
        out[i] = min(range(world), key=lambda r: (load[r], r))
        load[out[i]] += math.prod(shapes[i]) * min(shapes[i])
    return out


def orthogonalized(g: torch.Tensor, coefficients, steps: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration on a matrix [A, B], in dtype (torch's, for any dtype)."""
    a, b, c = coefficients
    x = g.to(dtype, copy=True)  # never the caller's tensor (the momentum buffer without nesterov)
    if g.size(0) > g.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if g.size(0) > g.size(1) else x


def rms_ratio(adjust_lr_fn: str | None, shape) -> float:
    """torch's Muon rate adjustment for a [A, B] matrix."""
    A, B = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, A / B))
    return 0.2 * math.sqrt(max(A, B)) if adjust_lr_fn == "match_rms_adamw" else 1.0


def build_optimizers(config: OptimConfig, model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """The run's optimizers, in the order their states are saved."""
    if config.optimizer == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)]
    matrices, rest = muon_split(model)
    ns_dtype = torch.bfloat16 if matrices and matrices[0].device.type == "cuda" else torch.float32
    muon = Muon(
        matrices,
        lr=muon_lr(config),
        weight_decay=config.muon_weight_decay,
        adjust_lr_fn="match_rms_adamw",
        ns_dtype=ns_dtype,
    )
    return [muon] + ([torch.optim.AdamW(rest, lr=config.lr, weight_decay=config.weight_decay)] if rest else [])


def muon_lr(config: OptimConfig) -> float:
    return config.muon_lr if config.muon_lr is not None else 10 * config.lr


def build_schedules(config: OptimConfig, optimizers: list, total: int) -> list:
    """One LambdaLR per optimizer, all following lr_lambda."""
    f = lr_lambda(total, config.warmup_ratio, config.schedule)
    return [torch.optim.lr_scheduler.LambdaLR(opt, f) for opt in optimizers]


def lr_lambda(total: int, warmup_ratio: float, schedule: str = "cosine"):
    """Step -> the factor on the peak rate: (step + 1) / warmup while warming up, then cosine or
    linear decay to 0 at `total`."""
    warmup = math.ceil(total * warmup_ratio)

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        done = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1 + math.cos(math.pi * done)) if schedule == "cosine" else 1.0 - done

    return f
