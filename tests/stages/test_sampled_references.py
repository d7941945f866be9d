"""Sampled references (--temperature, --top-p, --top-k, --seed), regenerated here and from a server:
reproducible row by row (the same store twice from one seed; another batch size, the same rows;
another seed, other rows), recorded, refused where they do not apply, shown by `pipeline info`."""

import functools
import json
import shutil

import pytest

import stages.extract.run as extract_run
from pipeline.reference_server import ReferenceServer, ServerInfo
from pipeline.sampling import row_seed
from stages.extract.config import ExtractConfig
from stages.extract.run import run
from store.errors import ConfigError, StoreMismatch
from store.format.schema import Sampling, to_json
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader
from store.summary import render, summarize
from tests.conftest import SMALL, assert_stores_equal
from tests.fake_engine import FakeEngine

SAMPLED = dict(temperature=1.0, top_p=0.95, seed=1)


def sampled_config(path, dataset, shards="0-3", **over):
    return ExtractConfig(
        store=str(path), dataset=str(dataset), shards=shards, num_shards=4, **{**SMALL, **SAMPLED, **over}
    )


def completions(path) -> dict[int, list[int]]:
    """{dataset row: its stored completion} over the committed shards."""
    store = HiddenStore(str(path))
    return {
        s.row_id: s.tokens[s.prompt_len :].tolist() for shard in store.committed() for s in ShardReader(store, shard)
    }


@pytest.fixture(scope="module")
def sampled_store(tmp_path_factory, small_dataset):
    path = tmp_path_factory.mktemp("sampled") / "hs.zarr"
    run(sampled_config(path, small_dataset), log=lambda m: None)
    return path


def test_the_same_seed_makes_the_same_store_byte_for_byte(sampled_store, small_dataset, small_store, tmp_path):
    again = tmp_path / "again.zarr"
    run(sampled_config(again, small_dataset), log=lambda m: None)
    assert_stores_equal(sampled_store, again)
    ours, greedy = completions(sampled_store), completions(small_store)
    assert ours.keys() == greedy.keys()
    assert sum(ours[r] != greedy[r] for r in ours) >= len(ours) - 1  # sampled: not the greedy completions


def test_the_batch_size_and_the_shards_order_change_no_row(sampled_store, small_dataset, tmp_path):
    ours = completions(sampled_store)
    for size, shards in ((1, "3,1"), (5, "2,0")):
        other = tmp_path / f"b{size}.zarr"
        run(sampled_config(other, small_dataset, shards=shards, batch_size=size), log=lambda m: None)
        theirs = completions(other)
        assert len(theirs) > 4 and all(theirs[r] == ours[r] for r in theirs), size


def test_another_seed_draws_other_completions(sampled_store, small_dataset, tmp_path):
    other = tmp_path / "seed2.zarr"
    run(sampled_config(other, small_dataset, shards="0,1", seed=2), log=lambda m: None)
    ours, theirs = completions(sampled_store), completions(other)
    assert sum(theirs[r] != ours[r] for r in theirs) >= len(theirs) - 1


def test_a_near_zero_temperature_draws_the_greedy_completions(small_store, small_dataset, tmp_path):
    """The sampler at T -> 0 is the argmax: its rows equal the greedy store's."""
    cold = tmp_path / "cold.zarr"
    run(sampled_config(cold, small_dataset, shards="0,1", temperature=1e-4, top_p=None), log=lambda m: None)
    greedy = completions(small_store)
    assert all(tokens == greedy[r] for r, tokens in completions(cold).items())


def test_the_sampling_is_recorded_shown_and_kept(sampled_store, small_store, small_dataset, tmp_path):
    store = HiddenStore(str(sampled_store))
    assert store.attrs.compat.sampling == Sampling(temperature=1.0, top_p=0.95, top_k=None, seed=1)
    greedy = HiddenStore(str(small_store)).attrs.compat
    assert greedy.sampling is None and "sampling" in store.attrs.compat.differences(greedy)
    info = summarize(store)
    assert info["provenance"]["sampling"] == {"temperature": 1.0, "top_p": 0.95, "seed": 1}
    text = render(info)
    assert "responses: regenerate, sampled: temperature 1, top-p 0.95, seed 1" in text
    assert 0 < info["agreement"]["rate"] < 1 and "sampled references: below 100% by design, reported only" in text
    assert "reported only" not in render(summarize(HiddenStore(str(small_store))))
    copy = tmp_path / "copy.zarr"
    shutil.copytree(sampled_store, copy)  # a run that differs is refused before it writes anything
    for over in (dict(temperature=0.7), dict(seed=2), dict(top_k=20), dict(temperature=0.0, top_p=None, seed=None)):
        with pytest.raises(StoreMismatch, match="sampling"):
            run(sampled_config(copy, small_dataset, shards="3", **over), log=lambda m: None)


@pytest.mark.parametrize(
    "over,needle",
    [
        (dict(responses="dataset"), "--temperature 1.0: goes with --responses regenerate or server"),
        (dict(temperature=0.0, seed=None), "--top-p 0.95: goes with --temperature above 0"),
        (dict(temperature=0.0, top_p=None), "--seed 1: goes with --temperature above 0"),
        (dict(temperature=-0.5), "--temperature -0.5: must be at least 0"),
        (dict(top_p=0.0), "--top-p 0.0: must be in (0, 1]"),
        (dict(top_k=-1), "--top-k -1: must be at least 0"),
    ],
)
def test_sampling_settings_that_do_not_apply_are_refused_naming_the_flag(over, needle):
    with pytest.raises(ConfigError, match="^" + needle.replace("(", r"\(").replace("]", r"\]")):
        ExtractConfig(device="cpu", **{**SAMPLED, **over})


def test_cuts_that_cut_nothing_are_recorded_as_none():
    c = ExtractConfig(device="cpu", temperature=0.7, top_p=1.0, top_k=0)
    assert c.sampling() == Sampling(temperature=0.7, top_p=None, top_k=None, seed=0)
    assert ExtractConfig(device="cpu").sampling() is None
    ints = ExtractConfig(device="cpu", temperature=1, top_p=0.5).sampling()  # from Python: recorded as the CLI's
    assert to_json(ints) == to_json(ExtractConfig(device="cpu", temperature=1.0, top_p=0.5).sampling())
    assert json.dumps(to_json(ints)) == '{"temperature": 1.0, "top_p": 0.5, "seed": 0}'


def test_server_references_are_sampled_with_each_rows_seed(sampled_store, small_dataset, target, tmp_path, monkeypatch):
    """Every request carries the temperature, the cuts and its row's seed; an engine that samples a
    request as extraction samples that row gives the regenerated store's rows."""
    monkeypatch.setattr(extract_run, "ReferenceServer", functools.partial(ReferenceServer, backoff_s=0.01))
    path = tmp_path / "server.zarr"
    with FakeEngine(target) as engine:
        run(
            sampled_config(path, small_dataset, responses="server", server_url=engine.url, concurrency=4),
            log=lambda m: None,
        )
    rows = completions(path)
    assert rows == completions(sampled_store)
    by_seed = {b["seed"]: b for b in engine.bodies}
    assert len(by_seed) == len(engine.bodies) == len(rows)  # one request a row, each its own seed
    assert set(by_seed) == {row_seed(1, r) for r in rows}
    assert all(b["temperature"] == 1.0 and b["top_p"] == 0.95 and "top_k" not in b for b in engine.bodies)
    assert HiddenStore(str(path)).attrs.compat.sampling == HiddenStore(str(sampled_store)).attrs.compat.sampling


def test_sglang_requests_carry_the_sampling_and_the_rows_seed(monkeypatch):
    sent = []
    server = ReferenceServer("http://127.0.0.1:9", "m", 1, sampling=Sampling(temperature=0.6, top_k=20, seed=7))
    server.info = ServerInfo("http://127.0.0.1:9", "m", "sglang", "0.5")
    monkeypatch.setattr(server, "_post", lambda path, body, **kw: sent.append((path, body)) or {"output_ids": [5]})
    assert server.complete([1, 2, 3], 8, [0], row=42) == [5]
    assert sent == [
        (
            "/generate",
            {
                "input_ids": [1, 2, 3],
                "sampling_params": {
                    "temperature": 0.6,
                    "top_k": 20,
                    "sampling_seed": row_seed(7, 42),
                    "max_new_tokens": 8,
                    "stop_token_ids": [0],
                },
            },
        )
    ]
    server.sampling = None
    server.complete([1, 2, 3], 8, [0], row=42)
    assert sent[-1][1]["sampling_params"] == {"temperature": 0, "max_new_tokens": 8, "stop_token_ids": [0]}
    server.close()
