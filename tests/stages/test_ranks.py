"""One process decides, every process follows: on_main in a real gloo group of two."""

import pytest


class _Acc:
    """What on_main reads of an Accelerator, for a process of a plain gloo group."""

    def __init__(self, rank: int, world: int) -> None:
        self.process_index, self.num_processes, self.is_main_process = rank, world, rank == 0


def _rank(rank: int, path: str, out: dict) -> None:
    import torch.distributed as dist

    from stages.train.ranks import on_main
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
    from stages.train.ranks import on_main

    assert on_main(_Acc(0, 1), lambda: 7) == 7
    with pytest.raises(ValueError):
        on_main(_Acc(0, 1), lambda: int("x"))
