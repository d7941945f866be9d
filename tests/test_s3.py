"""The three commands on an object store, through a real S3 API (moto's server on 127.0.0.1, s3fs).
Opt-in: `pytest -m s3` (needs s3fs in the project's venv: `pip install -e '.[s3]'`; builds the
server's own venv once). Every process gets the server as its S3 endpoint from the environment."""

import signal
import time

import pytest

from tests.conftest import SMALL, assert_stores_equal
from tests.processes import evaluate, pipeline_proc, report, run_pipeline, train
from tests.s3 import extract_args

pytestmark = pytest.mark.s3
STRAY = ("Unclosed", "Traceback", "Exception ignored", "client_session")


def no_stray_lines(text: str) -> None:
    stray = [line for line in text.splitlines() if any(s in line for s in STRAY)]
    assert not stray, stray[:5]


def test_extract_check_train_and_evaluate_from_s3(s3, small_dataset, tmp_path):
    store = "s3://bucket/hs.zarr"
    p = run_pipeline(extract_args(store, small_dataset, "0-1"))
    assert p.returncode == 0, p.stderr[-2000:]
    no_stray_lines(p.stderr)
    info = run_pipeline(["info", store])
    assert info.returncode == 0 and "2/4 done (0-1)" in info.stdout, info.stdout + info.stderr
    verify = run_pipeline(["verify", store])
    assert verify.returncode == 0 and "checked 2 committed shard(s): all good" in verify.stdout, verify.stderr
    out = tmp_path / "run"
    t = train(
        [
            "--store",
            store,
            "--shards",
            "0",
            "--eval-shards",
            "1",
            "--out",
            out,
            "--max-steps",
            "20",
            "--workers",
            "1",
            "--anchors",
            "16",
            "--num-layers",
            "1",
            "--batch-size",
            "2",
            "--eval-every",
            "10",
        ]
    )
    assert t.returncode == 0, t.stderr[-3000:]
    no_stray_lines(t.stderr)
    done = next(line for line in t.stdout.splitlines() if line.startswith("done: "))
    assert "sample index of 2 shards built" in t.stderr and f"saved to {store}/_index/samples-" in t.stderr, t.stderr
    e = evaluate(store, out / "final", "1", tmp_path / "report")
    assert e.returncode == 0, e.stderr[-3000:]
    no_stray_lines(e.stderr)
    tau = report(tmp_path / "report")["tau"]
    print(f"\nthrough S3 ({s3.requests()} requests so far): {done}; evaluate.py tau {tau:.3f}")
    assert f"replay tau {tau:.3f}" in done  # the replay from S3 equals training's own


def test_a_killed_extraction_rerun_gives_the_identical_store(s3, small_dataset, tmp_path):
    whole, killed = "s3://bucket/whole.zarr", "s3://bucket/killed.zarr"
    p = run_pipeline(extract_args(whole, small_dataset, "0-3"))
    assert p.returncode == 0 and f"saved to {whole}/_index/samples-" in p.stdout, p.stdout  # complete: index saved
    proc = pipeline_proc(extract_args(killed, small_dataset, "0-3"), pause_after=3)  # inside shard 1
    deadline = time.time() + 300
    while time.time() < deadline and "PAUSED" not in proc.stderr.readline():
        pass
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    p = run_pipeline(extract_args(killed, small_dataset, "0-3"))
    assert p.returncode == 0, p.stderr[-2000:]
    no_stray_lines(p.stderr)
    assert_stores_equal(whole, killed)
    again = train(
        [
            "--store",
            whole,
            "--shards",
            "0-2",
            "--eval-shards",
            "3",
            "--out",
            tmp_path / "run",
            "--max-steps",
            "1",
            "--workers",
            "0",
            "--anchors",
            "16",
            "--num-layers",
            "1",
            "--batch-size",
            "2",
        ]
    )
    assert again.returncode == 0 and "sample index of 4 shards read from" in again.stderr, again.stderr[-2000:]


def test_a_sample_costs_at_most_two_requests_once_its_shard_is_open(s3, small_dataset, tmp_path):
    """Every sample of the small prompt set extracted with the shipped layout (chunks of 256 tokens in
    files of 4,096), read from S3 in batches of 4 by readers opened first (a loader worker's start-up,
    not counted), twice (a kept worker's next epoch): at most 2 requests a sample on average, all
    arrays, counted in moto's access log; the samples equal the local store's, bit for bit."""
    import fsspec
    import numpy as np
    import torch

    from stages.extract.config import ExtractConfig
    from stages.extract.run import run
    from store.hidden_store import HiddenStore
    from store.shard_reader import ShardReader, read_samples

    small_store = tmp_path / "hs.zarr"
    run(
        ExtractConfig(
            store=str(small_store),
            dataset=str(small_dataset),
            shards="0-3",
            num_shards=4,
            **{**SMALL, "chunk_tokens": 256, "shard_tokens": 4096},
        ),
        log=lambda m: None,
    )

    url = "s3://bucket/reads.zarr"
    files = [
        p
        for p in small_store.rglob("*")
        if p.is_file() and not p.relative_to(small_store).as_posix().startswith(("_locks/", "_index/"))
    ]
    fsspec.filesystem("s3").put(
        [str(p) for p in files], [f"{url}/{p.relative_to(small_store).as_posix()}" for p in files]
    )
    local, remote = HiddenStore(str(small_store)), HiddenStore(url)
    readers = {s: ShardReader(remote, s) for s in sorted(remote.committed())}
    refs = [(s, i) for s, r in readers.items() for i in range(len(r)) if r._direct]  # opens each reader's arrays
    order = [refs[k] for k in np.random.default_rng(0).permutation(len(refs))]
    before = s3.requests()
    for _ in range(2):
        for lo in range(0, len(order), 4):
            batch = order[lo : lo + 4]
            for (s, i), got in zip(batch, read_samples([(readers[s], i, None, None) for s, i in batch])):
                want = ShardReader(local, s)[i]
                assert torch.equal(got.hidden.view(torch.int16), want.hidden.view(torch.int16))
                assert torch.equal(got.tokens, want.tokens) and torch.equal(got.loss_mask, want.loss_mask)
    per_sample = (s3.requests() - before) / (2 * len(order))
    print(f"\n{per_sample:.2f} requests a sample ({2 * len(order)} samples read from {len(readers)} shards)")
    assert per_sample <= 2


def evaluate_at_t1(store: str, checkpoint, out) -> dict:
    """evaluate.py --temperature 1 on shard 1 of `store` -> its report's tau_at_temperature."""
    e = evaluate(store, checkpoint, "1", out, "--temperature", "1")
    assert e.returncode == 0, e.stderr[-3000:]
    no_stray_lines(e.stderr)
    return report(out)["tau_at_temperature"]


def test_a_final_state_store_on_s3_is_the_local_one_and_trains_and_replays_at_t1_as_it(s3, small_dataset, tmp_path):
    """pipeline extract --final-state onto S3 makes the local store bit for bit (final states included);
    train.py --soft-targets reads its final states from S3; evaluate.py --temperature 1 replays the same
    tau@1 from S3 as from the local copy."""
    store, local = "s3://bucket/final.zarr", tmp_path / "final.zarr"
    for where in (store, str(local)):
        p = run_pipeline(extract_args(where, small_dataset, "0-1", "--final-state"))
        assert p.returncode == 0, p.stderr[-2000:]
        no_stray_lines(p.stderr)
    assert_stores_equal(store, local)
    t = train(
        [
            "--store",
            store,
            "--shards",
            "0",
            "--eval-shards",
            "1",
            "--out",
            tmp_path / "run",
            "--max-steps",
            "10",
            "--workers",
            "1",
            "--anchors",
            "16",
            "--num-layers",
            "1",
            "--batch-size",
            "2",
            "--soft-targets",
            "tv",
        ]
    )
    assert t.returncode == 0, t.stderr[-3000:]
    no_stray_lines(t.stderr)
    remote = evaluate_at_t1(store, tmp_path / "run" / "final", tmp_path / "from_s3")
    assert remote == evaluate_at_t1(str(local), tmp_path / "run" / "final", tmp_path / "from_disk")
    assert 1 <= remote["tau"] and s3.requests() > 0
