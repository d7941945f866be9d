"""train.py with --data-order node end to end: a run stopped and resumed equals one straight through,
and a process reads its node's shards window after window."""

import json

import torch

from pipeline.drafter import checkpoint
from tests.processes import TINY, losses, train


def test_a_node_ordered_run_resumes_exactly_and_reads_one_shard_at_a_time(small_store, tmp_path):
    """One process is one node: with windows of one shard it reads the 4 shards one after another
    (each epoch: 7 batches of 2 of the 14 samples, every shard's samples in one run), and a run
    stopped after step 10 (mid-epoch) and resumed gives the losses and weights of the straight run."""
    common = [
        "--store",
        small_store,
        "--max-steps",
        20,
        "--save-every",
        10,
        "--audit",
        *TINY,
        "--data-order",
        "node",
        "--shuffle-window",
        1,
    ]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    r = train([*common, "--out", straight])
    assert r.returncode == 0, r.stderr
    r = train([*common, "--out", resumed], stop_after=10)
    assert r.returncode == 130, r.stderr
    state = json.loads((resumed / "step-10" / "trainer_state.json").read_text())
    assert state["position"]["epoch"] == 1 and state["position"]["layout"] == [1, 1]
    r = train([*common, "--out", resumed, "--resume"])
    assert r.returncode == 0, r.stderr
    assert losses(resumed) == losses(straight) and len(losses(straight)) == 20
    a, b = checkpoint.load(straight / "final")[1], checkpoint.load(resumed / "final")[1]
    assert all(torch.equal(a[k], b[k]) for k in a)
    read = [tuple(x) for x in json.loads((straight / "audit" / "rank-0.json").read_text())["samples"]]
    assert len(read) == 40
    for epoch in (read[:14], read[14:28]):
        assert len(set(epoch)) == 14
        shards = [s for s, _ in epoch]
        runs = [s for i, s in enumerate(shards) if i == 0 or shards[i - 1] != s]
        assert sorted(runs) == sorted(set(shards)) and len(runs) == 4  # each shard read in one run
    assert [s for s, _ in read[:14]] != [s for s, _ in read[14:28]]  # the shards' order changes by epoch
