"""--responses server against a real vLLM (CPU platform). Opt-in: `pytest -m engine` (builds the
engine venv once, about 6 GB, then starts vLLM on 127.0.0.1; several minutes). The target is the
shipped tiny target, or $DFLASH_ENGINE_TARGET."""

import os
from pathlib import Path

import pytest

from pipeline import TINY_TARGET
from pipeline.errors import EngineError
from stages.extract.config import ExtractConfig
from stages.extract.run import run
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader
from tests.engines import VllmServer

pytestmark = pytest.mark.engine
MODEL = Path(os.environ.get("DFLASH_ENGINE_TARGET", TINY_TARGET))
SETTINGS = dict(
    max_new_tokens=32,
    max_length=256,
    batch_size=4,
    dtype="bf16",
    device="cpu",
    chunk_tokens=32,
    shard_tokens=64,
    num_shards=64,
    responses="server",
    concurrency=8,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = VllmServer(MODEL, tmp_path_factory.mktemp("vllm") / "server.log").start()
    yield s
    s.stop()


def extract(path, url, shards, log=print):
    return run(ExtractConfig(store=str(path), target=str(MODEL), shards=shards, server_url=url, **SETTINGS), log=log)


def test_references_are_what_vllm_returns_for_the_same_ids(server, tmp_path):
    summary = extract(tmp_path / "hs.zarr", server.url, "0-3")
    store = HiddenStore(str(tmp_path / "hs.zarr"))
    print(
        f"\nvLLM references: {summary['samples']} samples, {summary['tokens']} tokens, agreement "
        f"{summary['agreement']}, engine {store.attrs.engine}"
    )
    assert store.attrs.engine["engine"] == "vllm" and store.attrs.engine["version"]
    eos = list(store.attrs.eos_token_ids)
    checked = 0
    for shard in store.committed():
        for s in ShardReader(store, shard):
            prompt, stored = s.tokens[: s.prompt_len].tolist(), s.tokens[s.prompt_len :].tolist()
            limit = store.attrs.compat.completion_limit(s.prompt_len)
            assert stored == server.complete(prompt, limit, eos), s.row_id
            checked += 1
    assert checked == summary["samples"] > 0
    assert summary["agreement"]["tokens"] > 0


def test_the_server_killed_mid_run_then_a_rerun_resumes(tmp_path):
    path = tmp_path / "hs.zarr"
    server = VllmServer(MODEL, tmp_path / "server.log").start()
    lines = []

    def kill_after_first_shard(message):
        lines.append(message)
        if message.startswith("shard "):
            server.stop()

    try:
        with pytest.raises(EngineError, match="failed after") as error:
            extract(path, server.url, "0-3", log=kill_after_first_shard)
    finally:
        server.stop()
    store = HiddenStore(str(path))
    done = list(store.committed())
    print(f"\nkilled after {done}: {lines[-1]}\nerror: {error.value}")
    assert 1 <= len(done) < 4 and not list((path / "_locks").glob("*.lock"))
    server = VllmServer(MODEL, tmp_path / "server2.log").start()
    try:
        summary = extract(path, server.url, "0-3")
    finally:
        server.stop()
    assert summary["shards_skipped"] == done and list(HiddenStore(str(path)).committed()) == [0, 1, 2, 3]
