"""--cache-dir and --cache-size (stages/cache_flags.py): parsed and checked alike in train.py and
evaluate.py, the bound the directory records used (and a different --cache-size said, not applied),
and the training loader's readers fetch through the cache they name."""

import os
import subprocess
import sys

import pytest
import torch

from stages.cache_flags import make, warning
from stages.evaluate.config import EvalConfig
from stages.settings import format_size
from stages.train.config import DataConfig, TrainConfig
from stages.train.dataset import StoreBatches
from stages.train.samples import index_samples
from store.errors import ConfigError
from store.hidden_store import HiddenStore
from store.io import node_cache
from store.io.node_cache import NodeCache
from tests.conftest import REPO
from tests.stages.test_command import parse
from tests.store.io.node_cache_files import Files, read
from tests.store.io.test_node_cache import cached_files, index_rows, upload


@pytest.mark.parametrize("config_cls, extra", [(TrainConfig, []), (EvalConfig, ["--checkpoint", "ck"])])
def test_sizes_parse_and_a_size_goes_with_a_directory(config_cls, extra, tmp_path):
    def cache(args):  # train.py's are the data's settings
        config = parse(config_cls, [*args, *extra])
        return getattr(config, "data", config)

    config = cache(["--cache-dir", str(tmp_path), "--cache-size", "1.5T"])
    assert config.cache_dir == str(tmp_path) and config.cache_size == 3 << 39
    assert cache(["--cache-dir", "d", "--cache-size", "500GiB"]).cache_size == 500 << 30
    assert cache(["--cache-dir", "d"]).cache_size is None  # the directory's, when it records one (make)
    with pytest.raises(ConfigError, match="--cache-size 1K: is only used with --cache-dir"):
        parse(config_cls, ["--cache-size", "1K", *extra])
    with pytest.raises(ConfigError, match="--cache-size lots: expected a size"):
        parse(config_cls, ["--cache-dir", "d", "--cache-size", "lots", *extra])


@pytest.mark.parametrize("program, extra", [("train.py", []), ("evaluate.py", ["--checkpoint", "ck"])])
@pytest.mark.parametrize(
    "size, cache_dir, line",
    [
        (
            "inf",
            True,
            "error: --cache-size inf: expected a size such as '500G', '2T' or a number of bytes, finite and at least 0",
        ),
        (
            "nan",
            True,
            "error: --cache-size nan: expected a size such as '500G', '2T' or a number of bytes, finite and at least 0",
        ),
        (
            "-1G",
            True,
            "error: --cache-size -1G: expected a size such as '500G', '2T' or a number of bytes, finite and at least 0",
        ),
        ("0.5", True, "error: --cache-size 0.5: is 0.5 bytes: expected a whole number of bytes"),
        ("0", True, "error: --cache-size 0: must be positive"),
        ("1G", False, "error: --cache-size 1G: is only used with --cache-dir"),
        ("1.5TiB", False, "error: --cache-size 1.5T: is only used with --cache-dir"),
    ],
)
def test_a_bad_size_is_one_line_echoed_as_written(program, extra, size, cache_dir, line, tmp_path):
    """As a user runs it: exit code 2, one line, the size as it was written (or in its unit, not in
    bytes), and no cache directory made."""
    args = [*extra, "--store", tmp_path / "hs.zarr", "--out", tmp_path / "out", "--cache-size", size]
    r = run_script(program, [*args, *(["--cache-dir", tmp_path / "cache"] if cache_dir else [])])
    assert (r.returncode, r.stderr) == (2, line + "\n")
    assert sorted(tmp_path.iterdir()) == []


def test_follow_poll_without_follow_is_one_line(tmp_path):
    r = run_script("train.py", ["--store", tmp_path / "hs.zarr", "--out", tmp_path / "out", "--follow-poll", "5"])
    assert (r.returncode, r.stderr) == (2, "error: --follow-poll 5.0: is only used with --follow\n")
    followed = parse(TrainConfig, ["--follow", "--shards", "0-3", "--max-steps", "8"])
    assert followed.shard_schedule.follow_poll == 30.0  # the default, with --follow
    assert parse(TrainConfig, []).shard_schedule.follow_poll is None


def run_script(program: str, args: list) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, program, *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_loader_reads_an_object_store_through_the_cache(small_store, tmp_path):
    rows = [[(r,) for r in index_samples(HiddenStore(str(small_store)), [0, 1], 200)[k : k + 3]] for k in (0, 3)]
    location = upload(small_store)
    cache = NodeCache(str(tmp_path / "cache"), 1 << 30)
    want = [StoreBatches(str(small_store), rows)[k] for k in range(2)]
    got = [StoreBatches(location, rows, node_cache=cache)[k] for k in range(2)]
    for a, b in zip(want, got):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.hidden.view(torch.int16), b.hidden.view(torch.int16))
    assert cached_files(cache) and cached_files(cache) == index_rows(cache)[0]


def test_a_local_store_is_said_to_ignore_the_cache(small_store, tmp_path):
    config = DataConfig(store=str(small_store), cache_dir=str(tmp_path), cache_size=1 << 30)
    assert "is not used" in warning(config, HiddenStore(str(small_store)))
    assert warning(config, HiddenStore(upload(small_store))) is None
    assert warning(DataConfig(store=str(small_store)), HiddenStore(str(small_store))) is None


@pytest.mark.parametrize("config_cls, extra", [(TrainConfig, []), (EvalConfig, ["--checkpoint", "ck"])])
def test_a_cache_size_is_needed_only_for_a_directory_that_records_no_bound(config_cls, extra, tmp_path):
    def data(args):
        config = parse(config_cls, ["--store", "s3://b/hs.zarr", "--cache-dir", str(tmp_path / "cache"), *args, *extra])
        return getattr(config, "data", config)

    with pytest.raises(ConfigError) as e:
        make(data([]))
    assert str(e.value) == (
        f"--cache-size: is required with --cache-dir {tmp_path / 'cache'}, which records no bound yet (a new "
        "cache directory): e.g. --cache-size 500G"
    )
    assert not (tmp_path / "cache").exists()
    files = Files(tmp_path, 1, 100)
    read(files.view(make(data(["--cache-size", "2T"]))), files.paths)  # the first process: records 2T
    assert make(data([])).max_bytes == 2 << 40  # then --cache-size may be left out
    assert make(data(["--cache-size", "500G"])).max_bytes == 2 << 40  # and another is not applied


def test_a_size_the_directory_overrules_is_said_as_a_run_starts(small_store, tmp_path):
    """The documented case: training's 27T recorded, then an evaluation with --cache-size 2T on the node."""
    cache_dir, location = tmp_path / "cache", upload(small_store)
    files = Files(tmp_path, 1, 100)
    read(files.view(make(DataConfig(store=location, cache_dir=str(cache_dir), cache_size=27 << 40))), files.paths)
    config = EvalConfig(store=location, checkpoints=("ck",), cache_dir=str(cache_dir), cache_size=2 << 40)
    line = warning(config, HiddenStore(location, node_cache=make(config)))
    assert line.startswith(f"--cache-size 2T not applied: --cache-dir {cache_dir} keeps the bound recorded in it, 27T")
    assert f"delete {cache_dir}/bound.json while no process uses the directory" in line
    same = EvalConfig(store=location, checkpoints=("ck",), cache_dir=str(cache_dir))
    assert warning(same, HiddenStore(location, node_cache=make(same))) is None


@pytest.mark.parametrize("size", [1, 1000, 1 << 10, 3 << 39, 27 << 40, (1 << 40) + 1, 5 << 50])
def test_the_caches_sizes_read_as_the_flags_do(size):
    assert node_cache._size(size) == format_size(size)


def test_an_evaluation_with_a_smaller_size_on_a_trainings_cache_evicts_none_of_it(small_store, tmp_path):
    """docs/scale.md's case as a user runs it: train.py fills a node cache with --cache-size 1G (the
    directory records it); evaluate.py on the same directory with --cache-size 1K says in one line that
    its size is not applied and evicts nothing of the training's (the old code evicted them down to its
    1K); evaluate.py without --cache-size uses the directory's bound; a new directory needs one."""
    from tests.processes import TINY
    from tests.stages.test_node_cache_faults import REMOTE, remote

    cache, run = tmp_path / "cache", tmp_path / "run"
    train = ["--store", REMOTE, "--shards", "0-2", "--max-steps", 2, "--threads", 1, *TINY, "--out", run]
    r = remote("train", small_store, "never", [*train, "--cache-dir", cache, "--cache-size", "1G"])
    assert r.returncode == 0 and "warning: --cache" not in r.stderr, r.stderr[-3000:]
    trained = cached_files(NodeCache(str(cache), 1 << 30))
    assert len(trained) > 1 and node_cache.recorded_bound(str(cache)) == 1 << 30
    evaluate = ["--store", REMOTE, "--checkpoint", run / "final", "--max-prompts", 2, "--threads", 1]
    r = remote(
        "evaluate",
        small_store,
        "never",
        [*evaluate, "--out", tmp_path / "rep", "--cache-dir", cache, "--cache-size", "1K"],
    )
    assert r.returncode == 0, r.stderr[-3000:]
    said = [line for line in r.stderr.splitlines() if "--cache-size" in line]
    assert said == [
        f"warning: --cache-size 1K not applied: --cache-dir {cache} keeps the bound recorded in it, 1G (bound.json, "
        "written by the first process that used the directory), and this process evicts only beyond that; to "
        f"change the bound, delete {cache}/bound.json while no process uses the directory (the next run records "
        "its --cache-size), or leave --cache-size out"
    ]
    assert set(trained) <= set(cached_files(NodeCache(str(cache), 1 << 30)))  # the training's files all kept
    r = remote("evaluate", small_store, "never", [*evaluate, "--out", tmp_path / "rep2", "--cache-dir", cache])
    assert r.returncode == 0 and "--cache-size" not in r.stderr, r.stderr[-3000:]
    r = remote(
        "evaluate", small_store, "never", [*evaluate, "--out", tmp_path / "rep3", "--cache-dir", tmp_path / "new"]
    )
    assert (r.returncode, r.stderr) == (
        2,
        f"error: --cache-size: is required with --cache-dir {tmp_path / 'new'}, which records no bound yet (a new "
        "cache directory): e.g. --cache-size 500G\n",
    )
