"""The optimizers and schedules of stages/train/optim.py."""

import math
from pathlib import Path

import pytest
import torch

from stages.train.config import OptimConfig
from stages.train.optim import build_optimizers, build_schedules, lr_lambda, muon_split
from store.errors import ConfigError
from tests.drafters import config, drafter


def test_muon_takes_every_matrix_and_adamw_the_norms():
    m = drafter(config())
    matrices, rest = muon_split(m)
    names = {id(p): n for n, p in m.named_parameters()}
    assert {names[id(p)] for p in rest} == {n for n, p in m.named_parameters() if n.endswith("norm.weight")}
    assert all(p.ndim == 2 for p in matrices) and any(names[id(p)] == "fc.weight" for p in matrices)
    assert len(matrices) + len(rest) == len(list(m.parameters()))


def test_the_markov_matrices_go_to_adamw_only_when_asked():
    """--markov-optimizer adamw: a dspark drafter's two [V, r] Markov matrices leave Muon for AdamW (its
    confidence head's [1, H + r] row was AdamW's already); refused on a drafter without them and with
    --optimizer adamw."""
    m = drafter(config(head="dspark"))
    names = {id(p): n for n, p in m.named_parameters()}
    markov = {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
    matrices, rest = muon_split(m)
    assert markov <= {names[id(p)] for p in matrices}
    aside, kept = muon_split(m, "adamw")
    assert {names[id(p)] for p in kept} == {names[id(p)] for p in rest} | markov
    assert {names[id(p)] for p in aside} == {names[id(p)] for p in matrices} - markov
    muon, adamw = build_optimizers(OptimConfig(markov_optimizer="adamw"), m)
    assert {names[id(p)] for p in adamw.param_groups[0]["params"]} >= markov
    with pytest.raises(ConfigError, match=r"--markov-optimizer adamw: the drafter has no Markov head"):
        muon_split(drafter(config()), "adamw")
    with pytest.raises(ConfigError, match=r"--markov-optimizer adamw: is only used by --optimizer muon"):
        OptimConfig(optimizer="adamw", markov_optimizer="adamw")


def test_optimizers_and_their_rates():
    m = drafter(config())
    (adamw,) = build_optimizers(OptimConfig(lr=3e-4, optimizer="adamw"), m)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.param_groups[0]["lr"] == 3e-4
    muon, rest = build_optimizers(OptimConfig(lr=3e-4), m)  # the default
    assert isinstance(muon, torch.optim.Muon) and isinstance(rest, torch.optim.AdamW)
    assert muon.ns_dtype == torch.float32  # on CPU: no native bf16 matmul
    assert muon.param_groups[0]["lr"] == pytest.approx(3e-3) and rest.param_groups[0]["lr"] == 3e-4
    assert muon.param_groups[0]["weight_decay"] == 0.1 and muon.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    muon, _ = build_optimizers(OptimConfig(optimizer="muon", muon_lr=0.02), m)
    assert muon.param_groups[0]["lr"] == 0.02
    scheds = build_schedules(OptimConfig(optimizer="muon", warmup_ratio=0.2, schedule="linear"), [muon, rest], 10)
    assert [s.get_last_lr()[0] for s in scheds] == [
        pytest.approx(0.01),
        pytest.approx(1.5e-4),
    ]  # x (0 + 1) / 2, warming up


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_schedules_warm_up_then_decay_to_zero(schedule):
    f = lr_lambda(100, 0.04, schedule)
    assert [f(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0] and f(4) == 1.0 and f(100) == 0.0
    mid = f(4 + 48)
    assert mid == pytest.approx(0.5 if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert all(f(i) >= f(i + 1) for i in range(4, 100))
    if schedule == "linear":
        assert f(28) == pytest.approx(0.75)


def test_muon_flags_are_checked():
    with pytest.raises(ConfigError, match="--muon-lr 0.01: is only used by --optimizer muon"):
        OptimConfig(optimizer="adamw", muon_lr=0.01)
    with pytest.raises(ConfigError, match="--muon-lr -1.0: must be positive"):
        OptimConfig(optimizer="muon", muon_lr=-1.0)


@pytest.mark.parametrize("nesterov", [True, False])
def test_our_muon_in_bf16_is_torchs_and_in_fp32_close_to_it(nesterov):
    from stages.train.optim import Muon

    g = torch.Generator().manual_seed(0)
    shapes = [(64, 24), (24, 64), (32, 32)]
    start = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    runs = {}
    for name, make in (
        ("torch", lambda ps: torch.optim.Muon(ps, **kw)),
        ("bf16", lambda ps: Muon(ps, ns_dtype=torch.bfloat16, **kw)),
        ("fp32", lambda ps: Muon(ps, ns_dtype=torch.float32, **kw)),
    ):
        kw = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw", "nesterov": nesterov}
        ps = [torch.nn.Parameter(x.clone()) for x in start]
        opt = make(ps)
        for step in grads:
            for p, gr in zip(ps, step):
                p.grad = gr.clone()
            opt.step()
        runs[name] = (ps, opt.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(runs["torch"][0], runs["bf16"][0]))
    assert all(
        torch.equal(runs["torch"][1]["state"][i]["momentum_buffer"], runs["bf16"][1]["state"][i]["momentum_buffer"])
        for i in range(len(shapes))
    )
    moved = [float((b - a).abs().max()) for a, b in zip(start, runs["torch"][0])]
    off = [float((b - a).abs().max()) for a, b in zip(runs["torch"][0], runs["fp32"][0])]
    assert all(o < 0.05 * m for o, m in zip(off, moved)) and any(o > 0 for o in off)


def test_owners_balance_the_iterations_cost():
    from stages.train.optim import owners

    shapes = [(435, 128)] * 15 + [(128, 128)] * 10 + [(64, 128)] * 10 + [(128, 640)]
    assert owners(shapes, 1) == [0] * len(shapes)
    split = owners(shapes, 2)
    cost = [sum(a * b * min(a, b) for (a, b), o in zip(shapes, split) if o == r) for r in (0, 1)]
    assert set(split) == {0, 1} and max(cost) < 1.1 * min(cost)


def _muon_rank(rank: int, world: int, path: str, out: dict) -> None:
    """One process of a gloo group: the same parameters and gradients on every rank, three Muon steps;
    then a checkpoint in Accelerate's layout (what runs saved before the trainer state): the optimizer
    state (rank 0's file) and momentum shards (every rank's, as save_step wrote them) read back."""
    import torch.distributed as dist

    from stages.train.run_dir import MOMENTUM, load_momentum

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        ps, opt = _three_muon_steps()
        kept = {i for i, p in enumerate(ps) if "momentum_buffer" in opt.state.get(p, {})}
        held = sum(s["momentum_buffer"].numel() * s["momentum_buffer"].element_size() for s in opt.state.values())
        file = [opt.state_dict()]  # what every rank reads back: the file rank 0 wrote
        torch.save(owned(opt), Path(path).parent / MOMENTUM.format(rank))
        dist.broadcast_object_list(file, src=0)
        dist.barrier()
        loaded = {i for i, p in enumerate(ps) if "momentum_buffer" in opt.state.get(p, {})}
        opt.load_state_dict(file[0])
        load_momentum([opt], Path(path).parent)
        momentum = {i: opt.state[p]["momentum_buffer"].clone() for i, p in enumerate(ps) if p in opt.state}
        opt.load_state_dict(torch.load(Path(path).parent / "one-process.pt"))  # a checkpoint with no shards
        out[rank] = {
            "old": {i: opt.state[p]["momentum_buffer"].clone() for i, p in enumerate(ps) if p in opt.state},
            "params": [p.detach().clone() for p in ps],
            "kept": kept,
            "held": held,
            "loaded": loaded,
            "momentum": momentum,
            "messages": opt.broadcasts,
            "bytes": opt.broadcast_bytes,
        }
    finally:
        dist.destroy_process_group()


def owned(muon) -> dict:
    """A rank's momentum buffers by matrix index: its shard in Accelerate's layout (muon-momentum-rank-R.pt)."""
    return {i: s["momentum_buffer"] for i, (p, _) in enumerate(muon.matrices()) if (s := muon.state.get(p))}


SHAPES = [(64, 24), (24, 64), (32, 32), (48, 16), (8, 40)]


def _three_muon_steps():
    """Seeded parameters after three Muon steps on seeded gradients (in a group: the group's split)
    -> (the parameters, the optimizer)."""
    from stages.train.optim import Muon

    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    opt = Muon(ps, ns_dtype=torch.float32, lr=0.02, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return ps, opt


def _one_matrix_rank(rank: int, world: int, path: str, out: dict) -> None:
    """Two ranks, one matrix: rank 0 owns it, rank 1 must still get its update."""
    import torch.distributed as dist

    from stages.train.optim import Muon

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        p = torch.nn.Parameter(torch.ones(8, 4))
        opt = Muon([p], ns_dtype=torch.float32, lr=0.02, adjust_lr_fn="match_rms_adamw")
        p.grad = torch.arange(32.0).reshape(8, 4)
        opt.step()
        out[rank] = (p.detach().clone(), len(opt.state))
    finally:
        dist.destroy_process_group()


def test_a_matrix_owned_by_one_rank_reaches_the_other(tmp_path):
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_one_matrix_rank, args=(2, str(tmp_path / "rendezvous"), out), nprocs=2)
        (w0, n0), (w1, n1) = out[0], out[1]
    assert torch.equal(w0, w1) and not torch.equal(w0, torch.ones(8, 4)) and (n0, n1) == (1, 0)


def test_muon_split_over_two_processes_equals_one_process(tmp_path):
    """Each rank keeps the momentum of its own matrices only, orthogonalizes them and broadcasts its
    updates in one message a step: both ranks end with exactly the weights one process computes alone,
    and a checkpoint (rank 0's optimizer state, each rank's momentum shard) read back gives each rank
    its own share of the one process's momentum, bit for bit."""
    import torch.multiprocessing as mp

    from stages.train.optim import owners

    ps, opt = _three_muon_steps()
    alone = {i: opt.state[p]["momentum_buffer"] for i, p in enumerate(ps)}
    torch.save(opt.state_dict(), tmp_path / "one-process.pt")  # all the momentum in one file
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_muon_rank, args=(2, str(tmp_path / "rendezvous"), out), nprocs=2)
        ranks = [out[0], out[1]]
    split = owners(SHAPES, 2)
    for rank, got in enumerate(ranks):
        assert all(torch.equal(a, b) for a, b in zip(ps, got["params"]))
        mine = {i for i, o in enumerate(split) if o == rank}
        assert got["kept"] == mine == got["loaded"] == got["momentum"].keys()
        assert all(torch.equal(alone[i], got["momentum"][i]) for i in mine)
        assert got["old"].keys() == mine and all(torch.equal(alone[i], got["old"][i]) for i in mine)
        assert got["held"] == sum(math.prod(SHAPES[i]) * 4 for i in mine) < sum(math.prod(s) * 4 for s in SHAPES)
        assert got["messages"] == 3 * 2  # one broadcast per owner a step, not one per matrix
        assert got["bytes"] == 3 * sum(math.prod(s) * 4 for s in SHAPES)
    assert sorted(p.name for p in tmp_path.glob("muon-momentum-rank-*.pt")) == [
        "muon-momentum-rank-0.pt",
        "muon-momentum-rank-1.pt",
    ]


@pytest.mark.parametrize("shape", [(12, 40), (40, 12)], ids=["wide", "tall"])
@pytest.mark.parametrize("steps", [0, 5])
def test_the_iteration_written_into_a_buffer_is_the_same_update(shape, steps):
    """Muon.step's owners let the last iteration write into their broadcast buffer: the update read
    back from it (update_view) is the one computed without it, bit for bit, and lies in the buffer."""
    from stages.train.optim import iterated_shape, orthogonalized, update_view

    g = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    coefficients = (3.4445, -4.775, 2.0315)
    alone = orthogonalized(g, coefficients, steps, 1e-7, torch.float32)
    flat = torch.full((g.numel() + 5,), float("nan"))
    got = orthogonalized(g, coefficients, steps, 1e-7, torch.float32, out=flat[5:].view(iterated_shape(shape)))
    assert torch.equal(got, alone) and torch.equal(update_view(flat[5:], shape), alone)
