"""A step checkpoint's trainer state (OUT/step-N/training/), written by every rank at once with
torch.distributed.checkpoint (DCP), read back on any number of processes.

What it holds, as one flat DCP state dict (`state_of`; not flattened further: a value that is not a
tensor is pickled whole):
  model/<name>                  the drafter's fp32 weights (its state_dict; the frozen embedding and
                                head are non-persistent buffers, never saved)
  optim/<i>/<name>/<key>        optimizer i's state of parameter <name> (AdamW: step, exp_avg,
                                exp_avg_sq; Muon: momentum_buffer, held by the matrix's owner only)
  optim/<i>/groups              optimizer i's param_groups (rates, betas, ...), parameters by name
  schedulers, accelerator_step, scaler
                                the schedules, Accelerate's micro-step counter (gradient accumulation
                                resumes in phase) and the fp16 loss scaler (None without one)
  rng/<rank>                    that rank's random states (Python, NumPy, torch, CUDA), as Accelerate
                                kept them; a rank the saving run did not have keeps its own

Who writes what. DCP's default planner (torch 2.13: `_dedup_save_plans` -> `dedup_save_plans`,
save_to_lowest_rank False) does not put everything on rank 0: it gives each replicated item to the
plan with the fewest bytes so far, in the order items first appear (rank 0's plan first). Items only
one rank holds (Muon's momentum: its owner's; each rank's RNG) count only when their turn comes, after
the replicated weights were already balanced without them; Muon's owners balance the iteration's
cost, not bytes, so the ranks' totals follow the momentum's imbalance. Planned bytes per rank for the
27B drafter (1.73B parameters, Muon; bench/step_costs_bench.py `plan`): on 32 ranks the default's
busiest rank writes 1.05 GB against a mean of 0.43 (2.4x), on 8 ranks 1.95 against 1.73. `Spread`
plans it instead: single-holder items stay and count first, then the replicated ones go largest first
to the rank with the fewest bytes: 0.55 GB on 32 ranks (1.26x the mean; fc's weight alone is 0.52 GB),
1.74 on 8. Each rank writes its own file (__<rank>_0.distcp); the coordinator writes .metadata last,
after every rank's write returned.

Files are not fsynced (DCP's default would): nothing else of a step checkpoint is (the drafter's
files, Accelerate's before, the rename), so it would buy no durability for the step. On this shared
machine the fsynced write of a width-5120 layer was within the noise of the other (2 processes: 13.5
s against 14.7, runs of 11-17 s; bench/results/step_costs_checkpoint_cpu.json).

Loading is strict (`problems`): a missing or unexpected weight, an unknown optimizer or parameter, a
shape or dtype that differs is one line naming it. The checkpoint is read in place into the model's
own tensors; an optimizer's state into fresh tensors, only what this rank keeps (Muon: the matrices
it owns now, whoever owned them when saved).

Not async (dcp.async_save): the write would overlap the next steps' all-reduces on the same process
group, and the step directory's rename (the commit) would have to wait for a later collective; a
staged copy of the state would hold another 6.9 GB (weights) and 6.9-13.8 GB (optimizer) at 27B.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import warnings
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan

from stages.train.optim import Muon
from store.errors import ConfigError

METADATA = ".metadata"  # DCP's index, written last by the coordinator: its presence marks this layout


class Spread(DefaultSavePlanner):
    """DCP's planner with each item written by one rank as `spread` assigns it."""

    def create_global_plan(self, all_plans: list[SavePlan]):
        return super().create_global_plan(spread(all_plans))  # already unique: DCP's dedup keeps it as is


def spread(plans: list[SavePlan]) -> list[SavePlan]:
    """Each item kept in one rank's plan: items one rank holds stay and count first; replicated ones,
    largest first, go to the holder with the fewest bytes so far (ties: the lowest rank)."""
    holders, items = defaultdict(list), {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            holders[item.index].append(rank)
            items[item.index] = item
    load, keep = [0] * len(plans), {}
    for index, ranks in holders.items():
        if len(ranks) == 1:
            keep[index] = ranks[0]
            load[ranks[0]] += _size(items[index])
    shared = sorted((i for i, r in holders.items() if len(r) > 1), key=lambda i: -_size(items[i]))
    for index in shared:
        keep[index] = min(holders[index], key=lambda r: (load[r], r))
        load[keep[index]] += _size(items[index])
    return [
        dataclasses.replace(plan, items=[x for x in plan.items if keep[x.index] == rank])
        for rank, plan in enumerate(plans)
    ]


def _size(item) -> int:
    return item.tensor_storage_size() or 1  # an object: its bytes are unknown before it is pickled


def is_saved_here(directory: Path) -> bool:
    return (directory / METADATA).exists()


def save(directory: Path, acc, raw: torch.nn.Module, optimizers: list, schedulers: list) -> None:
    """Every rank: its share of the trainer state into DIRECTORY (which exists). A rank's failure
    fails the save on every rank, raised as that rank's own error (an OSError keeps its errno)."""
    state = state_of(acc, raw, optimizers, schedulers)
    try:
        with _one_process_is_meant():
            planner = Spread(flatten_state_dict=False)
            dcp.save(state, storage_writer=writer(directory), planner=planner, no_dist=not _distributed())
    except dcp.api.CheckpointException as e:
        raise _first_failure(e) from e


def writer(directory: Path) -> dcp.FileSystemWriter:
    """DCP's file writer without fsync: the files are as durable as the drafter's beside them and as
    Accelerate's were; the step is published by a rename (module doc)."""
    return dcp.FileSystemWriter(directory, sync_files=False)


def load(directory: Path, acc, raw: torch.nn.Module, optimizers: list, schedulers: list) -> None:
    """Every rank: the trainer state of DIRECTORY into the model (in place), optimizers, schedulers,
    Accelerate's counter and this rank's random states; refused first, in one line, when it does
    not fit (`problems`)."""
    saved = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    bad = problems(saved, raw, optimizers)
    if bad:
        raise ConfigError("--resume", directory, "does not fit this run's drafter or optimizers: " + "; ".join(bad))
    state = wanted(saved, raw, optimizers, _rank())
    try:
        planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)  # fills `state` itself
        with _one_process_is_meant():
            dcp.load(state, checkpoint_id=directory, planner=planner, no_dist=not _distributed())
    except dcp.api.CheckpointException as e:
        raise _first_failure(e) from e
    names = _names(raw)
    for i, opt in enumerate(_inner(optimizers)):
        opt.load_state_dict(torch_optimizer_state(state, i, opt, names, directory))
    for sched, s in zip(schedulers, state["schedulers"]):
        sched.load_state_dict(s)
    acc.step = state["accelerator_step"]
    if acc.scaler is not None and state["scaler"] is not None:
        acc.scaler.load_state_dict(state["scaler"])
    if f"rng/{_rank()}" in state:
        set_rng(state[f"rng/{_rank()}"])


def state_of(acc, raw: torch.nn.Module, optimizers: list, schedulers: list) -> dict:
    """The flat state this rank saves (module doc); tensors are the live ones, not copies."""
    names = _names(raw)
    state = {f"model/{k}": v for k, v in raw.state_dict().items()}  # fp32 weights, views of the parameters
    for i, opt in enumerate(_inner(optimizers)):
        for group in opt.param_groups:
            for p in group["params"]:
                for key, value in opt.state.get(p, {}).items():
                    state[f"optim/{i}/{names[id(p)]}/{key}"] = value
        state[f"optim/{i}/groups"] = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
            for g in opt.param_groups
        ]
    state["schedulers"] = [s.state_dict() for s in schedulers]
    state["accelerator_step"] = acc.step
    state["scaler"] = acc.scaler.state_dict() if acc.scaler is not None else None
    state[f"rng/{_rank()}"] = rng_state()
    return state


def problems(saved: dict, raw: torch.nn.Module, optimizers: list) -> list[str]:
    """What in the checkpoint's index `saved` {key: storage metadata} does not fit the model and
    optimizers (the same on every rank)."""
    now = raw.state_dict()
    weights = {k[len("model/") :]: m for k, m in saved.items() if k.startswith("model/")}
    out = [f"weight {k} missing" for k in now if k not in weights]
    out += [f"unexpected weight {k}" for k in weights if k not in now]
    out += [
        f"weight {k}: saved {list(m.size)} {m.properties.dtype}, now {list(now[k].shape)} {now[k].dtype}"
        for k, m in weights.items()
        if k in now and (tuple(m.size) != tuple(now[k].shape) or m.properties.dtype != now[k].dtype)
    ]
    params = [_params_by_name(raw, opt) for opt in _inner(optimizers)]
    for key, m in saved.items():
        parts = key.split("/")
        if parts[0] != "optim" or parts[-1] == "groups":
            continue
        i, name = int(parts[1]), "/".join(parts[2:-1])
        if i >= len(params) or name not in params[i]:
            out.append(f"unexpected optimizer state {key}")
        elif isinstance(m, TensorStorageMetadata) and m.size and tuple(m.size) != tuple(params[i][name].shape):
            out.append(f"optimizer state {key}: saved {list(m.size)}, parameter {list(params[i][name].shape)}")
    out += [f"optimizer {i} missing" for i in range(len(params)) if f"optim/{i}/groups" not in saved]
    return out


def wanted(saved: dict, raw: torch.nn.Module, optimizers: list, rank: int) -> dict:
    """The state dict this rank asks DCP to fill: the model's own tensors, fresh tensors for the
    optimizer state it keeps (Muon: its owned matrices only), placeholders for the objects."""
    state = {f"model/{k}": v for k, v in raw.state_dict().items()}
    params = [_params_by_name(raw, opt) for opt in _inner(optimizers)]
    kept = [_kept(opt, by_name, rank) for opt, by_name in zip(_inner(optimizers), params)]
    for key, m in saved.items():
        parts = key.split("/")
        if parts[0] == "optim" and parts[-1] != "groups":
            i, name = int(parts[1]), "/".join(parts[2:-1])
            if name in kept[i]:
                state[key] = _empty(m, params[i][name].device)
        elif parts[0] != "model" and (parts[0] != "rng" or key == f"rng/{rank}"):
            state[key] = None  # an object, replaced by the loaded one
    return state


def torch_optimizer_state(state: dict, i: int, opt, names: dict, directory: Path) -> dict:
    """Optimizer i's part of a loaded `state` in torch's layout (parameters by position), its
    parameter list checked against the optimizer's."""
    groups = state[f"optim/{i}/groups"]
    now = [[names[id(p)] for p in g["params"]] for g in opt.param_groups]
    was = [g["params"] for g in groups]
    if was != now:
        missing = sorted({n for g in now for n in g} - {n for g in was for n in g})
        extra = sorted({n for g in was for n in g} - {n for g in now for n in g})
        raise ConfigError(
            "--resume",
            directory,
            f"optimizer {i}'s parameters differ: missing {missing or 'none'}, unexpected {extra or 'none'}"
            + ("" if missing or extra else ", or grouped or ordered otherwise"),
        )
    position = {name: k for k, name in enumerate(n for g in now for n in g)}
    per_param = defaultdict(dict)
    prefix = f"optim/{i}/"
    for key, value in state.items():
        if key.startswith(prefix) and key != prefix + "groups":
            name, field = key[len(prefix) :].rsplit("/", 1)
            per_param[position[name]][field] = value
    groups = [{**g, "params": [position[n] for n in g["params"]]} for g in groups]
    return {"state": dict(per_param), "param_groups": groups}


def rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if s["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def _kept(opt, by_name: dict, rank: int) -> set[str]:
    """Names of the parameters whose state this rank keeps: all, but Muon's matrices it does not own."""
    if not isinstance(opt, Muon):
        return set(by_name)
    _, owners = opt.owner_of()
    mine = {id(p) for (p, _), o in zip(opt.matrices(), owners) if o == rank}
    return {n for n, p in by_name.items() if id(p) in mine}


def _params_by_name(raw: torch.nn.Module, opt) -> dict[str, torch.nn.Parameter]:
    names = _names(raw)
    return {names[id(p)]: p for g in opt.param_groups for p in g["params"]}


def _names(raw: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in raw.named_parameters()}


def _inner(optimizers: list) -> list:
    """The torch optimizers behind Accelerate's wrappers."""
    return [getattr(o, "optimizer", o) for o in optimizers]


def _empty(m, device) -> torch.Tensor:
    """A tensor to load a saved one into (0-d ones, AdamW's step, stay on the CPU as torch keeps them)."""
    return torch.empty(tuple(m.size), dtype=m.properties.dtype, device=device if len(m.size) else "cpu")


def _first_failure(e) -> BaseException:
    """The error of the lowest failing rank behind DCP's CheckpointException (a BaseException)."""
    return min(e.failures.items())[1][0]


@contextlib.contextmanager
def _one_process_is_meant():
    """DCP warns on every single-process save and load that it assumes one process: it is so."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0
