"""--responses server against an OpenAI-compatible server that answers like vLLM (tests/fake_engine.py;
the real vLLM runs in the opt-in tests/test_engine_vllm.py): the references, the provenance, retries,
rejected rows, and every way the server can be wrong or gone."""

import functools

import numpy as np
import pytest

import stages.extract.run as extract_run
from pipeline.errors import EngineError
from pipeline.reference_server import ReferenceServer
from stages.extract.config import ExtractConfig
from stages.extract.run import run
from store.errors import StoreMismatch
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader
from tests.conftest import SMALL
from tests.fake_engine import FakeEngine


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(extract_run, "ReferenceServer", functools.partial(ReferenceServer, backoff_s=0.01))


def server_config(path, dataset, url, shards="0-3", **over):
    return ExtractConfig(
        store=str(path),
        dataset=str(dataset),
        shards=shards,
        num_shards=4,
        responses="server",
        server_url=url,
        concurrency=4,
        **{**SMALL, **over},
    )


def arrays(path, shard, name):
    import zarr

    return zarr.open_group(str(path), mode="r")[f"shards/{shard:05d}/{name}"][:]


def test_server_references_are_the_targets_greedy_ones(tmp_path, target, small_dataset, small_store):
    with FakeEngine(target) as engine:
        url = engine.url.replace("http://", "http://user:secret@") + "/v1/"  # the OpenAI clients' form
        summary = run(server_config(tmp_path / "hs.zarr", small_dataset, url), log=lambda m: None)
    store = HiddenStore(str(tmp_path / "hs.zarr"))
    assert store.attrs.engine == {"url": engine.url, "model": "tiny", "engine": "vllm", "version": "0.0-fake"}
    assert store.attrs.compat.references == "vllm 0.0-fake tiny" and "secret" not in str(store.attrs.extract)
    assert summary["agreement"]["rate"] == 1.0
    reference = HiddenStore(str(small_store))  # the same rows regenerated in process
    for shard in range(4):  # the same samples in the same order: tokens and states
        for name in ("tokens", "row_ids", "loss_mask", "hidden"):
            assert np.array_equal(arrays(tmp_path / "hs.zarr", shard, name), arrays(small_store, shard, name)), name
    assert store.attrs.fingerprint != reference.attrs.fingerprint  # another source of references


def test_a_store_does_not_mix_reference_sources(tmp_path, target, small_dataset):
    with FakeEngine(target) as engine:
        run(server_config(tmp_path / "hs.zarr", small_dataset, engine.url, shards="0"), log=lambda m: None)
    with FakeEngine(target, model="other") as engine, pytest.raises(StoreMismatch, match="references"):
        run(server_config(tmp_path / "hs.zarr", small_dataset, engine.url, shards="1"), log=lambda m: None)
    with pytest.raises(StoreMismatch, match="responses"):
        run(
            ExtractConfig(
                store=str(tmp_path / "hs.zarr"), dataset=str(small_dataset), shards="1", num_shards=4, **SMALL
            ),
            log=lambda m: None,
        )


def test_transient_failures_are_retried_and_rejected_rows_counted(tmp_path, target, small_dataset):
    with FakeEngine(target, fail_first=3, reject_longer_than=40) as engine:
        summary = run(server_config(tmp_path / "hs.zarr", small_dataset, engine.url), log=lambda m: None)
    assert summary["skipped"]["server_rejected"] > 0 and summary["samples"] > 0
    kept = [
        len(s.tokens[: s.prompt_len])
        for shard in range(4)
        for s in ShardReader(HiddenStore(str(tmp_path / "hs.zarr")), shard)
    ]
    assert max(kept) <= 40


@pytest.mark.parametrize(
    "over,engine_args,needle",
    [
        ({"server_model": "other"}, {}, "--server-model other: http://127.0.0.1:"),
        ({}, {"vocab_shift": 1}, "has another vocabulary"),
    ],
)
def test_a_wrong_server_is_named_before_anything_is_written(tmp_path, target, small_dataset, over, engine_args, needle):
    with FakeEngine(target, **engine_args) as engine, pytest.raises(EngineError, match=needle):
        run(server_config(tmp_path / "hs.zarr", small_dataset, engine.url, **over), log=lambda m: None)
    assert not (tmp_path / "hs.zarr").exists()


def test_an_unreachable_server_is_one_line(tmp_path, small_dataset):
    from tests.processes import cli_args, run_pipeline

    p = run_pipeline(
        cli_args(tmp_path / "hs.zarr", small_dataset, "0-3")
        + ["--responses", "server", "--server-url", "http://127.0.0.1:9"]
    )
    assert p.returncode == 2
    line = p.stderr.strip().splitlines()[-1]
    assert (
        line.startswith("error: --server-url http://127.0.0.1:9: /v1/models failed after 5 tries")
        and "Connection" in line
    )
    assert not (tmp_path / "hs.zarr").exists()


def test_a_server_dying_mid_run_leaves_committed_shards_and_a_rerun_completes(
    tmp_path, target, small_dataset, small_store
):
    path = tmp_path / "hs.zarr"
    with FakeEngine(target, die_after=4) as engine, pytest.raises(EngineError, match="failed after 5 tries"):
        run(server_config(path, small_dataset, engine.url), log=lambda m: None)
    store = HiddenStore(str(path))
    done = list(store.committed())
    assert len(done) < 4 and all(store.commit_record(s).samples > 0 for s in done)
    assert not list((path / "_locks").glob("*.lock"))  # released on the way out
    with FakeEngine(target) as engine:
        summary = run(server_config(path, small_dataset, engine.url), log=lambda m: None)
    assert summary["shards_skipped"] == done and list(HiddenStore(str(path)).committed()) == [0, 1, 2, 3]
    for shard in range(4):
        assert np.array_equal(arrays(path, shard, "hidden"), arrays(small_store, shard, "hidden"))


def test_requests_stay_in_flight_across_shard_boundaries(tmp_path, target, small_dataset, monkeypatch):
    """With a server, the batches in flight never drop at a shard's end: the next shard's first
    requests are sent while this shard's last batches are captured (each shard still committed,
    as the first test checks, sample for sample)."""
    from stages.extract.extractor import Extractor

    events, start, finish = [], Extractor.start, Extractor.finish
    monkeypatch.setattr(
        Extractor,
        "start",
        lambda self, rows, writer: events.append(("start", writer.shard)) or start(self, rows, writer),
    )
    monkeypatch.setattr(
        Extractor,
        "finish",
        lambda self, batch, writer, shard: events.append(("finish", shard)) or finish(self, batch, writer, shard),
    )
    with FakeEngine(target) as engine:
        run(server_config(tmp_path / "hs.zarr", small_dataset, engine.url), log=lambda m: None)  # concurrency 4
    ahead = -(-4 // SMALL["batch_size"])  # batches kept in flight beyond the one being captured
    total, started, done = sum(e == "start" for e, _ in events), 0, 0
    assert len({s for _, s in events}) == 4 and total > 4  # every shard, several batches
    for kind, shard in events:
        if kind == "start":
            started += 1
            continue
        assert started - done == min(ahead + 1, total - done), (events, done)  # no drain at any shard's end
        done += 1
    last_finish = {s: i for i, (e, s) in enumerate(events) if e == "finish"}
    first_start = {s: min(i for i, (e, t) in enumerate(events) if e == "start" and t == s) for s in last_finish}
    assert all(first_start[s + 1] < last_finish[s] for s in range(3))


def test_the_summary_sizes_concurrency_to_the_capture_rate():
    from types import SimpleNamespace

    from stages.extract.run import server_use
    from stages.extract.summary import server_line

    engine = SimpleNamespace(requests=100, request_s=50.0, concurrency=4)  # 0.5 s a request
    use = server_use(engine, {"generate_s": 10.0, "loop_s": 20.0})  # 100 references in 10 s of not waiting
    assert use == {
        "requests": 100,
        "mean_request_s": 0.5,
        "concurrency": 4,
        "waited_s": 10.0,
        "loop_s": 20.0,
        "needed_in_flight": 5,
    }  # 0.5 s x 10 a second
    assert "keeping it busy needs about 5 in flight: --concurrency 5" in server_line(use)
    calm = server_use(engine, {"generate_s": 0.1, "loop_s": 20.0})
    assert "keeping it busy" not in server_line(calm) and "waited 0.1s of 20.0s" in server_line(calm)
