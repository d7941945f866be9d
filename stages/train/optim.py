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

The iteration is split over the run's processes (Muon.step): each matrix has one owner, the only
rank that keeps its momentum (at 27B width 6.9 GB in all, so 1/32 of it a rank on 32 GPUs instead
of all of it on each; arithmetic: 1.73B fp32 values) and orthogonalizes it. At 27B width the
iteration costs about 197 TFLOP per optimizer step (5 iterations over fc, 20 attention and 15 MLP
matrices; an MLP matrix alone 10.5), against about 144 TFLOP for one 4,096-token sequence's forward
and backward: done whole on every rank it would more than double a --batch-size 1 step, split over
8 ranks it adds about 25 TFLOP per rank. The updates then travel as one broadcast per owner, each
owner's iterations writing their last step straight into its one buffer, no copy (3.5 GB in bf16
per step in all, received by each rank),
instead of one broadcast per matrix (36 serial messages). A checkpoint holds every owner's momentum,
each rank writing its own share of the trainer state (stages/train/trainer_state.py), in parallel;
a resumed run, on any number of processes, keeps its own share.
"""

from __future__ import annotations

import math

import torch

from pipeline.drafter.model import HEAD_MODULES
from stages.train.config import OptimConfig
from store.errors import ConfigError

MARKOV = HEAD_MODULES[0]  # "markov_head.": the dspark Markov matrices' names (pipeline/drafter/dspark.py)


def muon_split(model: torch.nn.Module, markov: str = "muon") -> tuple[list, list]:
    """(the 2-D matrices with both sides > 1, everything else) among the trainable parameters,
    in named_parameters order; markov "adamw": a dspark drafter's Markov matrices among the rest
    (ConfigError when the drafter has none)."""
    matrices, rest, found = [], [], False
    for name, p in model.named_parameters():
        if p.requires_grad:
            aside = markov == "adamw" and name.startswith(MARKOV)
            found |= aside
            (matrices if p.ndim == 2 and min(p.shape) > 1 and not aside else rest).append(p)
    if markov == "adamw" and not found:
        raise ConfigError("--markov-optimizer", markov, "the drafter has no Markov head (train.py --head dspark)")
    return matrices, rest


class Muon(torch.optim.Muon):
    """torch.optim.Muon, its Newton-Schulz iteration in ns_dtype (the module doc says why), and split
    over the processes of a run: the gradients are the same on every rank after DDP's all-reduce, so
    each matrix has one owner (`owners`) that alone keeps its momentum and orthogonalizes it; each
    owner then broadcasts all its updates as one flat message, and every rank applies every update,
    as when each computed them all (the same values, bit for bit). state_dict is torch's, so holds this
    rank's share of the momentum, which a checkpoint's trainer state takes as it is, each rank writing
    its own (stages/train/trainer_state.py); load_state_dict and take_momentum (a checkpoint in
    Accelerate's layout, saved before) keep this rank's share."""

    def __init__(self, params, *, ns_dtype: torch.dtype, **kw) -> None:
        super().__init__(params, **kw)
        self.ns_dtype = ns_dtype
        self.broadcast_bytes = 0  # updates broadcast so far (each rank sends its share, receives the rest)
        self.broadcasts = 0  # messages so far: one per owner a step

    def matrices(self) -> list[tuple[torch.Tensor, dict]]:
        """(parameter, its group), in the groups' order: the same list on every rank."""
        return [(p, group) for group in self.param_groups for p in group["params"]]

    def owner_of(self) -> tuple[int, list[int]]:
        """(this rank, each matrix's owner)."""
        rank, world = _process()
        return rank, owners([p.shape for p, _ in self.matrices()], world)

    @torch.no_grad()
    def step(self, closure=None):
        """torch's _single_tensor_muon, step for step, with `orthogonalized` in ns_dtype, on this
        rank's matrices; the others' updates arrive by broadcast."""
        assert closure is None, "Muon here takes no closure"
        rank, mine = self.owner_of()
        pairs = self.matrices()
        several = _process()[1] > 1  # every other rank receives, even when one rank owns every matrix
        ready = [i for i, (p, _) in enumerate(pairs) if p.grad is not None]  # the same on every rank
        flats = {o: self.flat_for([pairs[i][0] for i in ready if mine[i] == o]) for o in set(mine)} if several else {}
        updates = {}  # matrix index -> its update [A, B] ns_dtype
        for i in ready:
            (p, group), owner = pairs[i], mine[i]
            if owner != rank:
                continue
            g = self.momentum_step(p, group)
            out = flats[rank][1].get(i) if several else None  # [iterated_shape] in rank's buffer
            updates[i] = orthogonalized(
                g, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype, out=out
            )
        if several:
            updates = self.exchanged(flats, pairs, rank)
        for i, u in updates.items():
            p, group = pairs[i]
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(u, alpha=-group["lr"] * rms_ratio(group["adjust_lr_fn"], p.shape))

    def momentum_step(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """The momentum buffer moved toward p's gradient -> what is orthogonalized (torch's, nesterov or not)."""
        if torch.is_complex(p) or p.grad.is_sparse:
            raise RuntimeError("Muon does not support complex parameters or sparse gradients")
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        buf.lerp_(p.grad, 1 - group["momentum"])
        return p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf

    def flat_for(self, params: list) -> tuple[torch.Tensor | None, dict]:
        """One owner's broadcast buffer [sum of sizes] ns_dtype and, by matrix index, its parts shaped as
        the iteration runs (None and nothing when it owns no updated matrix)."""
        index = {id(p): i for i, (p, _) in enumerate(self.matrices())}
        if not params:
            return None, {}
        flat = torch.empty(sum(p.numel() for p in params), dtype=self.ns_dtype, device=params[0].device)
        parts = flat.split([p.numel() for p in params])
        return flat, {index[id(p)]: part.view(iterated_shape(p.shape)) for p, part in zip(params, parts)}

    def exchanged(self, flats: dict, pairs: list, rank: int) -> dict:
        """Every matrix's update on every rank: one broadcast per owner of its buffer, which its
        iterations wrote into (every rank has the same gradients, so knows which matrices have one)."""
        out = {}
        for owner in sorted(flats):
            flat, parts = flats[owner]
            if flat is None:
                continue
            torch.distributed.broadcast(flat, src=owner)
            self.broadcast_bytes += flat.numel() * flat.element_size()
            self.broadcasts += 1
            for i, part in parts.items():
                out[i] = update_view(part.reshape(-1), pairs[i][0].shape)
        return out

    def take_momentum(self, shard: dict[int, torch.Tensor]) -> None:
        """The buffers of a saved shard ({matrix index: buffer}, any rank's, any number of processes) that this
        rank owns now, copied into its state; the rest left."""
        rank, mine = self.owner_of()
        pairs = self.matrices()
        for i, buf in shard.items():
            p = pairs[i][0]
            if mine[i] == rank:
                self.state[p]["momentum_buffer"] = buf.to(device=p.device, dtype=p.dtype, copy=True)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, then only this rank's share of the momentum kept (the owners may differ from the
        saving run's: another number of processes)."""
        super().load_state_dict(state_dict)
        rank, mine = self.owner_of()
        for (p, _), owner in zip(self.matrices(), mine):
            if owner != rank:
                self.state.pop(p, None)


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


def orthogonalized(
    g: torch.Tensor, coefficients, steps: int, eps: float, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration on a matrix [A, B], in dtype (torch's, for any dtype).
    out: where the last iteration writes, shaped as the iteration runs (`iterated_shape`), so a
    broadcast buffer needs no copy; the result is then a view of it."""
    a, b, c = coefficients
    x = g.to(dtype, copy=True)  # never the caller's tensor (the momentum buffer without nesterov)
    if g.size(0) > g.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for k in range(steps):
        gram = x @ x.T
        x = torch.addmm(
            x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a, out=out if k == steps - 1 else None
        )
    if out is not None and x.data_ptr() != out.data_ptr():
        x = out.copy_(x)  # no iteration ran
    return x.T if g.size(0) > g.size(1) else x


def iterated_shape(shape) -> tuple[int, int]:
    """The shape the iteration runs in for a matrix [A, B]: the shorter side first."""
    A, B = shape[:2]
    return (B, A) if A > B else (A, B)


def update_view(flat: torch.Tensor, shape) -> torch.Tensor:
    """A matrix's update [A, B] from its part of a broadcast buffer, laid out as the iteration ran."""
    v = flat.view(iterated_shape(shape))
    return v.T if shape[0] > shape[1] else v


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
    matrices, rest = muon_split(model, config.markov_optimizer)
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
