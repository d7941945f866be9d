"""The loader (stages/train/loader.py): its workers, kept through the epochs, and the shared memory
they need."""

import dataclasses

import pytest
import torch

from stages.train.dataset import StoreBatches
from stages.train.epoch_order import epoch_batches
from stages.train.recipe import BATCHINGS
from stages.train.samples import index_samples
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader


@pytest.mark.parametrize("batching", BATCHINGS)
def test_the_shared_memory_need_bounds_every_batch_and_is_met_by_the_largest(small_store, batching):
    from stages.train.config import DataConfig
    from stages.train.loader import PREFETCH, shared_memory_need

    store = HiddenStore(str(small_store))
    config = DataConfig(store=str(small_store), batch_size=3, max_length=60, workers=2, batching=batching)
    r = index_samples(store, [0, 1, 2, 3], config.max_length)
    need = shared_memory_need(config, r, len(store.attrs.taps), store.attrs.hidden_size, local_processes=8)
    per_batch, rest = divmod(need, 8 * config.workers * PREFETCH)
    batches = epoch_batches(r, 3, 0, 0, batching=batching, row_tokens=config.max_length)
    sizes = [StoreBatches(str(small_store), batches)[i].hidden.nbytes for i in range(len(batches))]
    assert rest == 0 and max(sizes) <= per_batch
    if batching != "packed":  # rows padded to the longest sample: a full batch holding it meets the bound
        longest = max(x.length for x in r)
        full = [i for i, b in enumerate(batches) if len(b) == 3 and longest in [x.length for row in b for x in row]]
        assert full and sizes[full[0]] == per_batch
    assert shared_memory_need(dataclasses.replace(config, workers=0), r, 5, 64, 8) == 0


def test_too_little_shared_memory_is_refused_in_one_line_naming_the_need_and_the_fix(tmp_path):
    import shutil

    from stages.train.config import DataConfig
    from stages.train.loader import check_shared_memory
    from store.errors import ConfigError

    free = shutil.disk_usage(tmp_path).free
    check_shared_memory(DataConfig(workers=2), free // 2, str(tmp_path))  # fits: nothing said
    with pytest.raises(ConfigError) as e:
        check_shared_memory(DataConfig(workers=2), 2 * free, str(tmp_path))
    line = str(e.value)
    assert "\n" not in line and line.startswith("--workers 2: ") and str(tmp_path) in line
    assert "--shm-size=" in line and "--workers 0" in line


def test_one_loader_keeps_its_workers_and_their_shard_readers_through_the_epochs(small_store, tmp_path, monkeypatch):
    """Two epochs' batches through one loader of 2 workers: every shard's reader is opened once per
    worker (a new loader each epoch opened them all again in new processes), on the worker's own
    store (not the forked copy of the one the loader was given), and the batches come in order,
    each equal to the same batch read alone."""
    import os

    from stages.train import dataset
    from stages.train.config import DataConfig
    from stages.train.loader import loader

    opened = tmp_path / "opened"
    store = HiddenStore(str(small_store))

    class Counting(ShardReader):
        def __init__(self, on, shard, record=None):
            with opened.open("a") as f:  # a worker is a forked process: it reports through a file
                f.write(f"{os.getpid()} {shard} {int(on is store)}\n")
            super().__init__(on, shard, record)

    monkeypatch.setattr(dataset, "ShardReader", Counting)
    refs = index_samples(store, [0, 1, 2], 200)
    epochs = [epoch_batches(refs, 2, 0, e) for e in (0, 1)]
    config = DataConfig(store=str(small_store), workers=2, on_corrupt="stop")
    got = list(loader(config, (b for batches in epochs for b in batches), False, set(), store=store, node_cache=None))
    want = [b for batches in epochs for b in batches]
    lines = [tuple(map(int, x.split())) for x in opened.read_text().splitlines()]
    assert len({pid for pid, _, _ in lines}) == 2 and os.getpid() not in {pid for pid, _, _ in lines}  # two workers
    assert len(lines) == len(set(lines)) <= 2 * 3  # a reader per worker and shard, opened once
    assert not any(given for _, _, given in lines)  # each worker on a store it opened
    assert len(got) == len(want)
    for batch, rows in list(zip(got, want))[::7]:
        alone = StoreBatches(str(small_store), [rows])[0]
        assert torch.equal(batch.tokens, alone.tokens) and torch.equal(
            batch.hidden.view(torch.int16), alone.hidden.view(torch.int16)
        )


def test_without_workers_the_loader_reads_through_the_store_it_was_given(small_store, monkeypatch):
    """--workers 0: the batches are read in the process, through the run's one store (every shard
    reader on it), and equal the same batches read by a dataset that opened its own."""
    from stages.train import dataset
    from stages.train.config import DataConfig
    from stages.train.loader import loader

    store, on = HiddenStore(str(small_store)), []

    class Recording(ShardReader):
        def __init__(self, given, shard, record=None):
            on.append(given is store)
            super().__init__(given, shard, record)

    monkeypatch.setattr(dataset, "ShardReader", Recording)
    rows = list(epoch_batches(index_samples(store, [0, 1], 200), 2, 0, 0))[:3]
    got = list(loader(DataConfig(store=str(small_store), workers=0), rows, False, set(), store=store, node_cache=None))
    assert len(got) == 3 and on and all(on)
    monkeypatch.undo()
    for batch, batch_rows in zip(got, rows):
        alone = StoreBatches(str(small_store), [batch_rows])[0]
        assert torch.equal(batch.tokens, alone.tokens) and torch.equal(
            batch.hidden.view(torch.int16), alone.hidden.view(torch.int16)
        )
