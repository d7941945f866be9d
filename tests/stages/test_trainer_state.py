"""The trainer state (stages/train/trainer_state.py): who writes what, strict loading, and a state
saved on one number of processes read back exactly on another (gloo processes)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stages.train import trainer_state
from stages.train.config import OptimConfig
from stages.train.optim import build_optimizers, build_schedules
from store.errors import ConfigError


def plan_of(state: dict):
    from torch.distributed.checkpoint.default_planner import create_default_local_save_plan

    return create_default_local_save_plan(state, False)


def planned_bytes(plan) -> int:
    return sum(x.tensor_storage_size() or 0 for x in plan.items)


def test_spread_keeps_single_holders_and_balances_the_replicated_bytes():
    """Two ranks with the same weights, rank 0 owning the momentum of 2 matrices and rank 1 of 6
    (Muon's owners balance the iteration's cost, not bytes): every item is written once, a rank's own
    items by it, and the bytes come out even, where DCP's default (replicated items balanced before
    the single holders count) leaves rank 1 10/6 of rank 0's."""
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans

    weights = {f"model/w{i}": torch.zeros(64, 32) for i in range(8)}
    own = [{f"optim/0/w{i}/momentum_buffer": torch.zeros(64, 32) for i in mine} for mine in ([0, 1], range(2, 8))]
    plans = [plan_of({**weights, **own[r]}) for r in (0, 1)]
    ours = trainer_state.spread(plans)
    written = [x.index.fqn for p in ours for x in p.items]
    assert sorted(written) == sorted([*weights, *own[0], *own[1]])  # each once
    assert all(k in {x.index.fqn for x in ours[r].items} for r in (0, 1) for k in own[r])
    even = [planned_bytes(p) for p in ours]
    assert even[0] == even[1] == 8 * 64 * 32 * 4
    default = [planned_bytes(p) for p in dedup_save_plans(plans)]
    assert default == [6 * 64 * 32 * 4, 10 * 64 * 32 * 4]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))


def _trained(model, optimizer: str):
    """Three optimizer steps on seeded data -> (optimizers, schedulers, Accelerate's stand-in)."""
    config = OptimConfig(optimizer=optimizer)
    opts = build_optimizers(config, model)
    scheds = build_schedules(config, opts, 10)
    for k in range(3):
        model(torch.randn(4, 16, generator=torch.Generator().manual_seed(k))).pow(2).mean().backward()
        for o in opts:
            o.step()
            o.zero_grad()
        for s in scheds:
            s.step()
    return opts, scheds, SimpleNamespace(step=6, scaler=None)


def _fresh(model, optimizer: str):
    config = OptimConfig(optimizer=optimizer)
    opts = build_optimizers(config, model)
    return opts, build_schedules(config, opts, 10), SimpleNamespace(step=0, scaler=None)


def _state(model, opts, scheds, acc) -> dict:
    """Everything a resume must restore, by name, on this rank (Muon: its owned momentum only)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"w/{n}": p.detach().clone() for n, p in model.named_parameters()}
    for i, o in enumerate(opts):
        for p, s in o.state.items():
            out |= {f"o{i}/{names[id(p)]}/{k}": v.clone() for k, v in s.items()}
        out[f"lr{i}"] = o.param_groups[0]["lr"]
    return out | {"sched": [s.last_epoch for s in scheds], "acc": acc.step}


def _rank(rank: int, world: int, path: str, directory: str, mode: str, out: dict) -> None:
    import torch.distributed as dist

    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        model = _model()
        if mode == "save":
            opts, scheds, acc = _trained(model, "muon")
            trainer_state.save(Path(directory), acc, model, opts, scheds)
        else:
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            opts, scheds, acc = _fresh(model, "muon")
            trainer_state.load(Path(directory), acc, model, opts, scheds)
        out[rank] = _state(model, opts, scheds, acc)
    finally:
        if world > 1:
            dist.destroy_process_group()


@pytest.mark.parametrize("saved,loaded", [(2, 1), (1, 2)])
def test_saved_on_one_number_of_processes_loads_exactly_on_another(tmp_path, saved, loaded):
    """Muon (its momentum with each matrix's owner) and AdamW (the norms): weights, both optimizers'
    states, rates, schedules and Accelerate's counter come back bit for bit; each rank keeps the
    momentum of the matrices it owns now; each saving rank wrote its own file."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        before, after = manager.dict(), manager.dict()
        mp.spawn(_rank, args=(saved, str(tmp_path / "r1"), str(tmp_path / "ck"), "save", before), nprocs=saved)
        mp.spawn(_rank, args=(loaded, str(tmp_path / "r2"), str(tmp_path / "ck"), "load", after), nprocs=loaded)
        before, after = dict(before), dict(after)
    files = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert files == [".metadata", *(f"__{r}_0.distcp" for r in range(saved))]
    whole = {k: v for r in before.values() for k, v in r.items()}  # every owner's momentum
    for state in after.values():
        assert set(state) <= set(whole)
        for k, v in state.items():
            assert torch.equal(v, whole[k]) if isinstance(v, torch.Tensor) else v == whole[k], k
    momentum = lambda s: {k for k in s if k.endswith("momentum_buffer")}  # noqa: E731
    assert set().union(*map(momentum, after.values())) == momentum(whole)  # all of it, somewhere
    if loaded > 1:
        assert not momentum(after[0]) & momentum(after[1])  # each matrix's once


def _saved(tmp_path, model, optimizer="adamw") -> Path:
    opts, scheds, acc = _trained(model, optimizer)
    trainer_state.save(tmp_path / "ck", acc, model, opts, scheds)
    return tmp_path / "ck"


@pytest.mark.parametrize(
    "other,expected",
    [
        (
            lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 9)),
            "weight 2.weight: saved [8, 32] torch.float32, now [9, 32] torch.float32; weight 2.bias: saved [8] "
            "torch.float32, now [9] torch.float32; optimizer state optim/0/2.weight/exp_avg: saved [8, 32], "
            "parameter [9, 32]",
        ),
        (
            lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32)),
            "unexpected weight 2.weight; unexpected weight 2.bias; unexpected optimizer state",
        ),
        (
            lambda: torch.nn.Sequential(
                torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8), torch.nn.Linear(8, 8)
            ),
            "weight 3.weight missing; weight 3.bias missing",
        ),
    ],
    ids=["shape", "unexpected", "missing"],
)
def test_a_state_of_another_model_is_refused_naming_the_key(tmp_path, other, expected):
    directory = _saved(tmp_path, _model())
    model = other()
    opts, scheds, acc = _fresh(model, "adamw")
    with pytest.raises(ConfigError) as e:
        trainer_state.load(directory, acc, model, opts, scheds)
    text = str(e.value)
    assert text.startswith(f"--resume {directory}: does not fit this run's drafter or optimizers: ")
    assert expected in text and "\n" not in text


def test_another_optimizer_is_refused_naming_it(tmp_path):
    """Saved with AdamW alone, loaded into Muon + AdamW: the matrices' AdamW state has no place."""
    directory = _saved(tmp_path, _model(), "adamw")
    model = _model()
    opts, scheds, acc = _fresh(model, "muon")
    with pytest.raises(ConfigError, match=r"unexpected optimizer state optim/0/0.bias/exp_avg"):
        trainer_state.load(directory, acc, model, opts, scheds)


def test_a_failed_write_raises_the_writers_own_error(tmp_path, monkeypatch):
    """DCP wraps a rank's failure in CheckpointException (a BaseException, which `except Exception`
    misses); save raises the rank's error itself, so a full disk keeps its errno (run_dir's
    not_saved_when_full reads it)."""
    import errno

    from torch.distributed.checkpoint import filesystem

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(filesystem, "_write_item", full)
    model = _model()
    opts, scheds, acc = _trained(model, "adamw")
    (tmp_path / "ck").mkdir()
    with pytest.raises(OSError) as e:
        trainer_state.save(tmp_path / "ck", acc, model, opts, scheds)
    assert e.value.errno == errno.ENOSPC
