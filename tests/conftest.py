"""Shared fixtures: the shipped tiny target in fp32, a small prompt set, and one extracted store."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.modules.setdefault("fla", None)  # CPU tests: the PyTorch Gated DeltaNet path, always
if os.environ.get("PYTEST_XDIST_WORKER"):  # one xdist worker per core: one intra-op thread each
    # The environment too: the stages run in-process set their threads from it (pipeline.device's
    # default_threads: else cores / processes, 2 on CI's 2 cores), and the processes the tests start
    # inherit it. Two threads in each of two workers on 2 cores made a tiny training step ~10x slower.
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

from pipeline import DEFAULT_PROMPTS, TINY_TARGET  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# Small and fast, and every row kind the extractor must handle.
SMALL = dict(
    max_new_tokens=24, max_length=160, batch_size=3, dtype="fp32", device="cpu", chunk_tokens=32, shard_tokens=64
)


def small_rows(n: int = 14) -> list[dict]:
    rows = [json.loads(line) for line in DEFAULT_PROMPTS.read_text().splitlines()[:n]]
    rows.insert(3, {"messages": [{"role": "user", "content": "   "}]})  # empty prompt
    rows.insert(7, {"messages": [{"role": "user", "content": "def f(x):\n" + "    x = x + 1\n" * 120}]})  # too long
    return rows


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in small_rows()))
    return path


@pytest.fixture(scope="session")
def target():
    from pipeline.target import loading

    return loading.load(str(TINY_TARGET), "cpu", "fp32", "auto")


@pytest.fixture(scope="session")
def small_store(tmp_path_factory, small_dataset) -> Path:
    """Shards 0-3 of 4 over the small prompt set, extracted in-process."""
    from stages.extract.config import ExtractConfig
    from stages.extract.run import run

    path = tmp_path_factory.mktemp("stores") / "hs.zarr"
    run(
        ExtractConfig(store=str(path), dataset=str(small_dataset), shards="0-3", num_shards=4, **SMALL),
        log=lambda m: None,
    )
    return path


@pytest.fixture(scope="session")
def fp8_store(tmp_path_factory, small_dataset) -> Path:
    """small_store's shards extracted again with --hidden-format fp8."""
    from stages.extract.config import ExtractConfig
    from stages.extract.run import run

    path = tmp_path_factory.mktemp("stores") / "fp8.zarr"
    run(
        ExtractConfig(
            store=str(path), dataset=str(small_dataset), shards="0-3", num_shards=4, hidden_format="fp8", **SMALL
        ),
        log=lambda m: None,
    )
    return path


@pytest.fixture(scope="session")
def final_store(tmp_path_factory, small_dataset) -> Path:
    """small_store's shards extracted again with --final-state."""
    from stages.extract.config import ExtractConfig
    from stages.extract.run import run

    path = tmp_path_factory.mktemp("stores") / "final.zarr"
    run(
        ExtractConfig(
            store=str(path), dataset=str(small_dataset), shards="0-3", num_shards=4, final_state=True, **SMALL
        ),
        log=lambda m: None,
    )
    return path


def damage_states(store: Path, shard: int, n: int = 256) -> Path:
    """Flip n bytes in the middle of the first state chunk file of a committed shard; returns the file."""
    hidden = store / f"shards/{shard:05d}/hidden"  # chunk files c.K.0.0, or c/K/0/0 before format revision 5
    chunk = sorted(p for p in hidden.rglob("*") if p.is_file() and p.name != "zarr.json")[0]
    data = bytearray(chunk.read_bytes())
    for k in range(len(data) // 2, len(data) // 2 + n):
        data[k] ^= 0x5A
    chunk.write_bytes(bytes(data))
    return chunk


@pytest.fixture
def store_copy(small_store, tmp_path) -> Path:
    """A copy of the small store to damage."""
    dst = tmp_path / "copy.zarr"
    shutil.copytree(small_store, dst)
    return dst


def assert_stores_equal(a: Path, b: Path) -> None:
    """Same committed shards, same root content, every array equal bit for bit."""
    import zarr

    from store.hidden_store import HiddenStore

    sa, sb = HiddenStore(str(a)), HiddenStore(str(b))
    assert sa.attrs.fingerprint == sb.attrs.fingerprint
    assert sa.attrs.compat == sb.attrs.compat
    ca, cb = sa.committed(), sb.committed()
    assert list(ca) == list(cb)
    ga, gb = zarr.open_group(str(a), mode="r"), zarr.open_group(str(b), mode="r")
    for name in ("target/embed_tokens", "target/lm_head"):
        assert np.array_equal(ga[name][:], gb[name][:]), name
    for shard in ca:
        assert ca[shard].checksums == cb[shard].checksums, shard
        final = ("final_state",) if sa.attrs.compat.final_state else ()
        for name in ("hidden", "tokens", "loss_mask", "offsets", "prompt_lens", "row_ids", *final):
            x, y = ga[f"shards/{shard:05d}/{name}"][:], gb[f"shards/{shard:05d}/{name}"][:]
            assert x.shape == y.shape and np.array_equal(x, y), (shard, name)


@pytest.fixture(scope="session")
def trained_drafter(small_store, tmp_path_factory) -> Path:
    """A drafter trained for 40 steps on shards 0-2 of the small store (3 held out): it accepts drafts."""
    from tests.processes import TINY, train

    out = tmp_path_factory.mktemp("trained") / "run"
    r = train(["--store", small_store, "--out", out, "--max-steps", 40, "--eval-shards", "3", "--lr", "3e-3", *TINY])
    assert r.returncode == 0, r.stderr
    return out / "final"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server on 127.0.0.1 (tests/s3.py) as every process's S3 endpoint, with a bucket `bucket`."""
    pytest.importorskip("s3fs", reason="the object-store tests need s3fs: pip install -e '.[s3]'")
    from tests.s3 import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3") / "moto.log").start()
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)  # every child process; fsspec read its environment at import here:
    import fsspec.config
    import s3fs

    fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = server.url
    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir("bucket")
    yield server
    fsspec.config.conf["s3"].pop("endpoint_url", None)
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    server.stop()
