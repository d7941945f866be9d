"""stages/evaluate/prompts.py: the prompts evaluation replays come from the store's index (the same
sample as reading every shard), only the sampled prompts' shards are opened, and the threaded read
gives the shard readers' samples in order."""

import shutil

import numpy as np
import pytest
import torch

from stages.evaluate import prompts as prompts_mod
from stages.evaluate.config import EvalConfig
from stages.evaluate.prompts import Prompts
from stages.evaluate.shards import choose_shards
from store import index_file
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader


def by_shard_readers(store, shards, limit, seed):
    """The sample as evaluation drew it before the index: every chosen shard opened and read."""
    refs, lengths = [], []
    for shard in shards:
        reader = ShardReader(store, shard)
        n = np.diff(reader.offsets)
        keep = np.flatnonzero(n > reader.prompt_lens)
        refs += [(shard, int(i)) for i in keep]
        lengths += n[keep].tolist()
    pick = np.arange(len(refs))
    if limit is not None and limit < len(refs):
        pick = np.sort(np.random.default_rng(seed).choice(len(refs), limit, replace=False))
    return [refs[i] for i in pick], max(lengths[i] for i in pick)


@pytest.mark.parametrize(
    "shards,limit,seed", [([0, 1, 2, 3], None, 0), ([0, 1, 2, 3], 7, 0), ([0, 1, 2, 3], 7, 5), ([3, 1], 4, 2)]
)
def test_the_index_gives_the_sample_every_shard_gave(small_store, shards, limit, seed):
    store = HiddenStore(str(small_store))
    got = Prompts(store, shards, limit, seed)
    refs, longest = by_shard_readers(store, shards, limit, seed)
    assert got.refs == refs and got.max_length == longest
    assert got.available == sum(len(ShardReader(store, s)) for s in shards)  # every stored prompt has a completion


class Counting(ShardReader):
    opened: list[int] = []

    def __init__(self, store, shard, record=None):
        Counting.opened.append(shard)
        super().__init__(store, shard, record)


def test_only_the_sampled_prompts_shards_are_opened(small_store, monkeypatch):
    store = HiddenStore(str(small_store))
    index, _ = index_file.load(store)
    monkeypatch.setattr(prompts_mod, "ShardReader", Counting)
    Counting.opened = []
    prompts = Prompts(store, [0, 1, 2, 3], 2, seed=1, index=index)
    assert Counting.opened == []  # the sample is drawn from the index alone
    sampled = {s for s, _ in prompts.refs}
    assert len(sampled) < 4  # two prompts cannot come from all four shards
    list(prompts.read(prompts.refs))
    assert set(Counting.opened) == sampled


@pytest.mark.parametrize("threads,ahead", [(1, 1), (3, 2), (8, 8)])
def test_threaded_read_gives_each_sample_in_order(small_store, threads, ahead):
    store = HiddenStore(str(small_store))
    prompts = Prompts(store, [0, 1, 2, 3], None, seed=0)
    refs = prompts.refs[::-1]  # not in store order: shards are reopened
    got = list(prompts.read(refs, ahead=ahead, threads=threads))
    assert [(s.shard, s.index) for s in got] == refs
    for s in got[::5]:
        want = ShardReader(store, s.shard)[s.index]
        assert torch.equal(s.tokens, want.tokens) and torch.equal(
            s.hidden.view(torch.int16), want.hidden.view(torch.int16)
        )
        assert s.prompt_len == want.prompt_len and s.row_id == want.row_id


def test_a_failed_read_is_raised_where_the_samples_are_taken(small_store, tmp_path):
    copy = tmp_path / "hs.zarr"
    shutil.copytree(small_store, copy)
    store = HiddenStore(str(copy))
    prompts = Prompts(store, [0, 1], None, seed=0)
    for f in (copy / "shards" / "00001" / "hidden").glob("c.*"):
        f.write_bytes(b"\0" * f.stat().st_size)
    taken = []
    with pytest.raises(Exception, match="00001"):
        for s in prompts.read(prompts.refs, threads=4):
            taken.append(s.shard)
    assert set(taken) <= {0}


def test_shards_committed_after_the_index_are_read_from_their_files(small_store):
    store = HiddenStore(str(small_store))
    full, _ = index_file.load(store)
    older = index_file.StoreIndex(
        {s: r for s, r in full.records.items() if s != 2}, {s: a for s, a in full.arrays.items() if s != 2}
    )
    config = EvalConfig(store=str(small_store), checkpoints=("x",), shards="1-2")
    chosen = choose_shards(config, store, [], [], older.records)
    assert chosen.ids == [1, 2]
    assert Prompts(store, [1, 2], None, 0, older).refs == Prompts(store, [1, 2], None, 0, full).refs
