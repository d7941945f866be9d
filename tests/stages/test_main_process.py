"""One process decides, every process follows: on_main (stages/train/main_process.py) in a real gloo group of two."""

from pathlib import Path

import pytest


class _Acc:
    """What on_main reads of an Accelerator, for a process of a plain gloo group."""

    def __init__(self, rank: int, world: int) -> None:
        self.process_index, self.num_processes, self.is_main_process = rank, world, rank == 0


def _rank(rank: int, path: str, out: dict) -> None:
    import torch.distributed as dist

    from stages.train.main_process import on_main
    from store.errors import UserError

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    acc, calls = _Acc(rank, 2), []
    try:
        got = on_main(acc, lambda: calls.append(rank) or {"decided_by": rank})

        def fail():
            raise UserError("hs.zarr: shards 3 are not committed")

        try:
            on_main(acc, fail)
            error = None
        except UserError as e:
            error = str(e)
        out[rank] = (got, calls, error)
    finally:
        dist.destroy_process_group()


def test_the_main_process_decides_alone_and_every_process_gets_its_answer_or_its_error(tmp_path):
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(str(tmp_path / "rendezvous"), out), nprocs=2)
        results = [out[0], out[1]]
    assert results[0] == ({"decided_by": 0}, [0], "hs.zarr: shards 3 are not committed")
    assert results[1] == ({"decided_by": 0}, [], "hs.zarr: shards 3 are not committed")  # it ran nothing itself


def test_one_process_runs_it_itself():
    from stages.train.main_process import on_main

    assert on_main(_Acc(0, 1), lambda: 7) == 7
    with pytest.raises(ValueError):
        on_main(_Acc(0, 1), lambda: int("x"))


def _out_rank(rank: int, path: str, outs: list, got: dict) -> None:
    import torch.distributed as dist

    from stages.train.setup import shared_out
    from store.errors import ConfigError

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    try:
        shared_out(_Acc(rank, 2), Path(outs[rank]))
        got[rank] = "ok"
    except ConfigError as e:
        got[rank] = str(e)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "not-shared"])
def test_an_out_that_not_every_process_sees_is_refused_on_every_process(tmp_path, shared):
    """Rank 1 given another directory stands for a node that mounts OUT elsewhere, or not at all."""
    import torch.multiprocessing as mp

    outs = [str(tmp_path / "out"), str(tmp_path / ("out" if shared else "elsewhere"))]
    with mp.Manager() as manager:
        got = manager.dict()
        mp.spawn(_out_rank, args=(str(tmp_path / "rendezvous"), outs, got), nprocs=2)
        results = [got[0], got[1]]
    if shared:
        assert results == ["ok", "ok"]
    else:
        for rank, text in enumerate(results):  # both stop, each naming OUT as it was given
            assert text.startswith(f"--out {outs[rank]}: is not shared by every process: rank(s) [1] do not see")
