"""The training step's fixed costs at real width (hidden 5120, vocabulary 248,320), part by part, on
CPU at reduced depth and size; before and after where the part changed (issue 50, point 5).

    python -m bench.step_costs_bench --threads 1 [--json bench/results/step_costs_cpu.json]

`forward`, `loss`, `backward`: one drafter layer of the released Qwen3.6-27B drafter's sizes (fc,
attention and MLP at width 5120) with the frozen head at the full vocabulary (fp32 on CPU, one tensor
for embedding and head), one row of --context tokens and --anchors blocks, through
stages/train/step.forward_loss and the loss's backward; the loss (stages/train/step.dflash_loss) is
timed by a wrapper put around it for the run, the forward is the rest of forward_loss.

`orthogonalisation`: Muon's Newton-Schulz (5 iterations, fp32) on ONE real-shaped matrix, a k_proj
[1024, 5120], timed once per repeat: a whole drafter's (fc [5120, 25600] alone is 14.8 TFLOP) takes
minutes a step on this CPU. Its FLOPs are given beside it (the 27B drafter's, 197 TFLOP a step, are arithmetic in
stages/train/optim.py).

`broadcast`, `checkpoint`: two gloo processes on this host, each with the same momentum and
updates of one drafter layer's attention matrices at real shapes (q, k, v, o: 52M fp32 values),
owners split by stages/train/optim.owners. broadcast: the updates as one message per matrix (the
path before: one torch.distributed.broadcast each, re-enacted here) against one message per owner
(Muon.exchanged, the path now: each owner's iterations write straight into its message buffer).
checkpoint: the momentum written by rank 0 alone (before: every rank held it all, the main process
saved it) against each rank writing its own share at once (Accelerate's layout's momentum shards,
muon-momentum-rank-N.pt); the slower rank's time.

`trainer_checkpoint` (also alone: --part checkpoint): a step checkpoint's trainer state for one
drafter layer at width 5120 (450.9M fp32 parameters, Muon's momentum with each matrix's owner and
AdamW's state of the norms: 3.6 GB; the frozen head is not saved, so built at vocabulary 1,000), with
1 and 2 gloo processes under Accelerate: before, Accelerate's save_state (the main process writes the
model and its optimizer files, each other rank its momentum shard: save_step before the trainer
state), against stages/train/trainer_state.save (every rank its share through
torch.distributed.checkpoint; no fsync, as Accelerate), and the same with every file fsynced (DCP's
default writer; `trainer_state_fsync`). Seconds from a barrier to
the last rank's return (median of --repeat, the writes taking turns; rank 0's runs in runs_s), and
bytes each rank wrote. `plan`: the bytes each rank is planned to write for
the 27B drafter (1.73B parameters, Muon) on 2, 8 and 32 ranks, DCP's default assignment against
trainer_state.Spread (meta tensors: no bytes written).

Not timed: the gradients' all-reduce (one host, no network: its bytes a step are in the metrics
log, fp32 by default) and host syncs (CPU tensors: nothing to wait for; on a GPU
tests/stages/test_train.py runs steps under CUDA's sync debug mode). The CPU is shared and has no
native bf16: these are the CPU's costs, not a GPU's.

`--toy`: width 64, vocabulary 1,000: seconds, to check the script works.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bench import harness

TOY = [[]]


def drafter(width: int, vocab: int, context: int):
    """One drafter layer at the released drafter's sizes for `width` -> (model, its config)."""
    import torch

    from pipeline.drafter.config import DrafterConfig, default_sizes
    from pipeline.drafter.model import Drafter

    sizes = {**default_sizes(width), "num_hidden_layers": 1}
    dc = DrafterConfig(
        hidden_size=width,
        vocab_size=vocab,
        block_size=16,
        mask_token_id=vocab - 1,
        target_layer_ids=tuple(range(5)),
        num_target_layers=64,
        layer_types=("full_attention",),
        **sizes,
    )
    g = torch.Generator().manual_seed(0)
    head = torch.empty(vocab, width).normal_(0, 0.02, generator=g)  # [V, H] fp32: embedding and head
    model = Drafter(dc, head, head)
    model.init_weights(torch.Generator().manual_seed(0), std=0.02)
    return model, dc


def step_parts(args) -> dict:
    """forward, loss and backward of one step (medians over --repeat, after one warm-up)."""
    from types import SimpleNamespace

    import torch

    import stages.train.step as st
    from stages.train.config import LossConfig

    model, dc = drafter(args.width, args.vocab, args.context)
    plan = st.LossPlan.of(LossConfig(anchors=args.anchors), dc, flex=False)
    g = torch.Generator().manual_seed(1)
    mask = torch.zeros(1, args.context, dtype=torch.bool)
    mask[:, args.context // 4 :] = True
    batch = SimpleNamespace(
        tokens=torch.randint(0, dc.vocab_size - 1, (1, args.context), generator=g),
        loss_mask=mask,
        hidden=torch.randn(1, args.context, 5, dc.hidden_size, generator=g).to(torch.bfloat16),  # [1, T, taps, H]
        starts=torch.zeros(1, args.context, dtype=torch.long),
    )
    real, spent = st.dflash_loss, {}

    def timed_loss(*a, **k):
        t0 = time.perf_counter()
        out = real(*a, **k)
        spent["loss"] = time.perf_counter() - t0
        return out

    runs = []
    st.dflash_loss = timed_loss
    try:
        for i in range(args.repeat + 1):
            t0 = time.perf_counter()
            out = st.forward_loss(model, model, batch, plan, st.step_generator(0, i, 0, 0, torch.device("cpu")))
            t1 = time.perf_counter()
            out.loss.backward()
            t2 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            runs.append({"forward_s": t1 - t0 - spent["loss"], "loss_s": spent["loss"], "backward_s": t2 - t1})
    finally:
        st.dflash_loss = real
    timed = runs[1:]  # the first call allocates
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "trainable_parameters": params,
        "chunk_rows_cpu": st.loss_chunk_rows(dc.vocab_size, torch.device("cpu")),
        "chunk_rows_gpu": st.loss_chunk_rows(dc.vocab_size, torch.device("cuda")),
        **{k: harness.median_of(r[k] for r in timed) for k in ("forward_s", "loss_s", "backward_s")},
    }


def orthogonalisation(args) -> dict:
    """One Newton-Schulz on one real-shaped matrix (module doc)."""
    import torch

    from stages.train.optim import orthogonalized

    shape = (args.width // 5, args.width)  # [1024, 5120] at width 5120: a k_proj
    g = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    m = harness.medians(lambda: orthogonalized(g, (3.4445, -4.775, 2.0315), 5, 1e-7, torch.float32), args.repeat)
    a, b = min(shape), max(shape)
    flops = 5 * (2 * a * a * b + 2 * a**3 + 2 * a * a * b)  # gram, its square, the product: per iteration
    return {
        "matrix": list(shape),
        "seconds": m["median_s"],
        "tflop": flops / 1e12,
        "gflop_per_s": flops / m["median_s"] / 1e9,
    }


def attention_shapes(width: int) -> list[tuple[int, int]]:
    """One drafter layer's attention matrices at width's sizes: q, k, v, o ([out, in])."""
    from pipeline.drafter.config import default_sizes

    s = default_sizes(width)
    q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    return [(q, width), (kv, width), (kv, width), (width, q)]


def _rank(rank: int, world: int, path: str, width: int, repeat: int, out: dict) -> None:
    """One of the two processes of `broadcast` and `checkpoint` (module doc)."""
    import torch
    import torch.distributed as dist

    from stages.train.optim import Muon, owners
    from stages.train.run_dir import MOMENTUM

    harness.torch_setup(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        shapes = attention_shapes(width)
        ps = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        opt = Muon(ps, ns_dtype=torch.float32, lr=0.01)
        mine = owners(shapes, world)
        for p in ps:
            p.grad = torch.ones_like(p)
            opt.state[p]["momentum_buffer"] = torch.full_like(p, 0.5)
        updates = {i: torch.full(p.shape, 0.25) for i, p in enumerate(ps) if mine[i] == rank}
        pairs = opt.matrices()
        flats = {o: opt.flat_for([p for p, m in zip(ps, mine) if m == o]) for o in set(mine)}
        for part in flats[rank][1].values():  # where the owner's iterations write (Muon.step)
            part.fill_(0.25)

        def per_matrix():  # the path before
            for i, p in enumerate(ps):
                u = updates[i] if mine[i] == rank else torch.empty(p.shape)
                dist.broadcast(u, src=mine[i])

        def timed(fn) -> float:
            runs = []
            for _ in range(repeat + 1):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                runs.append(time.perf_counter() - t0)
            dist.barrier()
            return harness.median_of(runs[1:])

        result = {
            "per_matrix_s": timed(per_matrix),
            "per_owner_s": timed(lambda: opt.exchanged(flats, pairs, rank)),
        }
        every = {i: opt.state[p]["momentum_buffer"] for i, p in enumerate(ps)}
        own = Path(path).parent / f"rank-{rank}"
        own.mkdir()

        def rank0_alone():  # the path before: every rank held all the momentum, the main process saved it
            if rank == 0:
                torch.save(every, own / "optimizer.bin")

        for p, owner in zip(ps, mine):  # the path now: each rank its own share
            if owner != rank:
                del opt.state[p]
        result.update(
            rank0_alone_s=timed(rank0_alone),
            every_rank_s=timed(lambda: torch.save(owned(opt), own / MOMENTUM.format(rank))),
            momentum_bytes=sum(v.numel() * 4 for v in every.values()),
        )
        out[rank] = result
    finally:
        dist.destroy_process_group()


def owned(muon) -> dict:
    """A rank's momentum buffers by matrix index: its shard in Accelerate's layout (muon-momentum-rank-R.pt)."""
    return {i: s["momentum_buffer"] for i, (p, _) in enumerate(muon.matrices()) if (s := muon.state.get(p))}


def between_ranks(args) -> dict:
    """broadcast and checkpoint on two gloo processes: the slower rank's medians."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(2, f"{tmp}/rendezvous", args.width, args.repeat, out), nprocs=2)
        ranks = [dict(out[0]), dict(out[1])]
    keys = ("per_matrix_s", "per_owner_s", "rank0_alone_s", "every_rank_s")
    slower = {k: max(r[k] for r in ranks) for k in keys}
    shapes = attention_shapes(args.width)
    return {
        "matrices": [list(s) for s in shapes],
        "values": sum(math.prod(s) for s in shapes),
        "momentum_bytes": ranks[0]["momentum_bytes"],
        "broadcast": {"messages_before": len(shapes), "messages_after": 2, **{k: slower[k] for k in keys[:2]}},
        "checkpoint": {k: slower[k] for k in keys[2:]},
    }


def _checkpoint_rank(rank: int, world: int, port: int, width: int, repeat: int, root: str, out: dict) -> None:
    """One of `trainer_checkpoint`'s processes (module doc): both writes, timed from a barrier."""
    import os

    import torch
    import torch.distributed.checkpoint as dcp

    from stages.train import trainer_state
    from stages.train.config import OptimConfig
    from stages.train.optim import build_optimizers, build_schedules
    from stages.train.run_dir import MOMENTUM, muons

    if world > 1:
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
        )
        os.environ.update(LOCAL_WORLD_SIZE=str(world))
    from accelerate import Accelerator

    harness.torch_setup(1)
    acc = Accelerator(cpu=True)
    model, _ = drafter(width, 1000, 0)
    opts = build_optimizers(OptimConfig(), model)
    scheds = build_schedules(OptimConfig(), opts, 100)
    for opt in opts:  # the state a step leaves: Muon's momentum with each matrix's owner, AdamW's of the norms
        kept = (
            {id(p) for p, o in zip((p for p, _ in opt.matrices()), opt.owner_of()[1]) if o == rank}
            if opt in muons(opts)
            else None
        )
        for group in opt.param_groups:
            for p in group["params"]:
                if kept is not None and id(p) in kept:
                    opt.state[p]["momentum_buffer"] = torch.full_like(p, 0.5)
                elif kept is None:
                    opt.state[p] = {
                        "step": torch.tensor(1.0),
                        "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p),
                    }
    wrapped, *prepared = acc.prepare(model, *opts)
    for sched in scheds:
        acc.register_for_checkpointing(sched)

    def before(d: Path) -> None:  # save_step before the trainer state
        acc.save_state(str(d))
        for muon in muons(prepared):
            if world > 1:
                torch.save(owned(muon), d / MOMENTUM.format(rank))

    def after(d: Path) -> None:
        trainer_state.save(d, acc, model, prepared, scheds)

    def fsynced(d: Path) -> None:  # trainer_state.save as DCP's default writer would do it: every file fsynced
        state = trainer_state.state_of(acc, model, prepared, scheds)
        planner = trainer_state.Spread(flatten_state_dict=False)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(d, sync_files=True), planner=planner, no_dist=world == 1)

    import shutil

    result, runs = {}, defaultdict(list)
    for _ in range(repeat):  # the writes in turn, so a load that comes and goes hits each alike
        for name, write in (("accelerate", before), ("trainer_state", after), ("trainer_state_fsync", fsynced)):
            d = Path(root) / name
            if rank == 0:
                d.mkdir()
            acc.wait_for_everyone()
            t0 = time.perf_counter()
            write(d)
            acc.wait_for_everyone()
            runs[f"{name}_s"].append(time.perf_counter() - t0)
            if rank == 0:
                result[f"{name}_bytes_per_rank"] = bytes_per_rank(d, name, world)
            acc.wait_for_everyone()
            if rank == 0:
                shutil.rmtree(d)
    result |= {k: harness.median_of(v) for k, v in runs.items()} | {"runs_s": dict(runs)}
    out[rank] = result
    acc.end_training()  # and the process group with it


def bytes_per_rank(d: Path, name: str, world: int) -> list[int]:
    """What each rank wrote into d: DCP's __<rank>_*.distcp (and rank 0 the .metadata); Accelerate's
    files by the main process, but each rank's momentum shard and random states."""
    sizes = {p.name: p.stat().st_size for p in d.iterdir()}
    if name.startswith("trainer_state"):
        return [
            sum(v for k, v in sizes.items() if k.startswith(f"__{r}_")) + (sizes[".metadata"] if r == 0 else 0)
            for r in range(world)
        ]
    own = [sizes.get(f"muon-momentum-rank-{r}.pt", 0) + sizes.get(f"random_states_{r}.pkl", 0) for r in range(world)]
    return [sum(sizes.values()) - sum(own[1:]), *own[1:]]


def trainer_checkpoint(args) -> dict:
    """`trainer_checkpoint` with 1 and 2 processes (module doc)."""
    import torch.multiprocessing as mp

    out = {}
    for world in (1, 2):
        with tempfile.TemporaryDirectory(dir=args.scratch) as tmp, mp.Manager() as manager:
            got = manager.dict()
            mp.spawn(_checkpoint_rank, args=(world, 29640 + world, args.width, args.repeat, tmp, got), nprocs=world)
            ranks = [dict(got[r]) for r in range(world)]
        out[f"processes_{world}"] = {
            "accelerate_s": max(r["accelerate_s"] for r in ranks),
            "trainer_state_s": max(r["trainer_state_s"] for r in ranks),
            "trainer_state_fsync_s": max(r["trainer_state_fsync_s"] for r in ranks),
            "runs_s": ranks[0]["runs_s"],
            "accelerate_bytes_per_rank": ranks[0]["accelerate_bytes_per_rank"],
            "trainer_state_bytes_per_rank": ranks[0]["trainer_state_bytes_per_rank"],
        }
    return out


def plan(width: int) -> dict:
    """Bytes each rank is planned to write for the 27B drafter's trainer state (module doc)."""
    import torch
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
    from torch.distributed.checkpoint.default_planner import create_default_local_save_plan

    from pipeline.drafter.checkpoint import expected_shapes
    from pipeline.drafter.config import DrafterConfig, default_sizes
    from stages.train.optim import owners
    from stages.train.trainer_state import spread

    sizes = default_sizes(width)
    dc = DrafterConfig(
        hidden_size=width,
        vocab_size=248_320,
        block_size=16,
        mask_token_id=1,
        target_layer_ids=tuple(range(5)),
        num_target_layers=64,
        layer_types=("full_attention",) * sizes["num_hidden_layers"],
        **sizes,
    )
    shapes = expected_shapes(dc)
    matrices = [(k, v) for k, v in shapes.items() if len(v) == 2 and min(v) > 1]
    weights = {f"model/{k}": torch.empty(v, device="meta") for k, v in shapes.items()}
    out = {"parameters": sum(math.prod(v) for v in shapes.values())}
    for world in (2, 8, 32):
        mine = owners([v for _, v in matrices], world)
        plans = []
        for r in range(world):
            momentum = {f"optim/0/{k}/m": torch.empty(v, device="meta") for (k, v), o in zip(matrices, mine) if o == r}
            plans.append(create_default_local_save_plan({**weights, **momentum}, r == 0))
        for name, assign in (("default", dedup_save_plans), ("spread", spread)):
            b = [sum(x.tensor_storage_size() or 0 for x in p.items) for p in assign(plans)]
            out[f"ranks_{world}_{name}"] = {"max_gb": max(b) / 1e9, "mean_gb": sum(b) / world / 1e9}
    return out


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--repeat", type=int, default=3, help="timed calls of each part (their median)")
    p.add_argument("--context", type=int, default=64, help="tokens of the training row")
    p.add_argument("--anchors", type=int, default=2, help="blocks of the row")
    p.add_argument(
        "--part", choices=("all", "checkpoint"), default="all", help="every part, or trainer_checkpoint and plan alone"
    )
    p.add_argument(
        "--scratch", default=None, help="where the checkpoints are written (default: the system's temporary directory)"
    )
    args = harness.parse(p)
    args.width, args.vocab = (64, 1000) if args.toy else (5120, 248_320)
    if args.toy:
        args.repeat, args.context = 1, 48
    harness.torch_setup(args.threads)
    t0 = time.time()
    result = {"width": args.width, "threads": args.threads}
    if args.part == "all":
        result.update(
            vocab=args.vocab,
            context=args.context,
            anchors=args.anchors,
            step=step_parts(args),
            orthogonalisation=orthogonalisation(args),
            between_ranks=between_ranks(args),
        )
    result.update(trainer_checkpoint=trainer_checkpoint(args), plan=plan(args.width))
    result["wall_s"] = round(time.time() - t0, 1)
    harness.emit(result, args)


if __name__ == "__main__":
    main()
