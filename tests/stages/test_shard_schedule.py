"""Training while extraction runs (train.py --follow): each epoch takes the shards committed when it
begins, the schedule is recorded, and a run equals its schedule replayed on the finished store."""

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from pipeline.drafter import checkpoint
from stages.train.config import TrainConfig
from stages.train.epoch_order import epoch_length
from stages.train.position import Position
from stages.train.samples import refs_of
from stages.train.shard_schedule import FILE, ShardSchedule, schedule_of
from store import index_file
from store.errors import ConfigError, NotCommitted
from store.format import layout
from store.hidden_store import HiddenStore
from tests.processes import TINY, losses, train


class OneProcess:
    """What decide() needs of an Accelerator on one process."""

    num_processes, is_main_process = 1, True


def growing(small_store: Path, dst: Path, first: int = 2) -> Path:
    """A copy of the small store whose shards from `first` on are not there yet (files nor commit)."""
    shutil.copytree(small_store, dst, ignore=shutil.ignore_patterns("_index"))
    for s in range(first, 4):
        shutil.rmtree(dst / layout.shard_group(s))
        (dst / layout.commit_key(s)).unlink()
    return dst


def commit(src: Path, dst: Path, shard: int) -> None:
    """Commit a shard as extraction does: its files first, its commit file last (by a rename)."""
    shutil.copytree(src / layout.shard_group(shard), dst / layout.shard_group(shard))
    tmp = dst / "_commits" / f".{shard}.tmp"
    shutil.copyfile(src / layout.commit_key(shard), tmp)
    tmp.rename(dst / layout.commit_key(shard))


def config(store, out, **kw) -> TrainConfig:
    poll = {"follow_poll": 1e-9} if kw.get("follow") else {}  # --follow-poll goes with --follow only
    return TrainConfig.of(store=str(store), out=str(out), shards="0-3", max_steps=10, **poll, **kw)


def test_follow_takes_shards_at_epoch_starts_and_records_them(small_store, tmp_path):
    store_path = growing(small_store, tmp_path / "grow.zarr")
    (tmp_path / "out").mkdir()
    store = HiddenStore(str(store_path))
    index, _ = index_file.load(store)
    sched = schedule_of(config(store_path, tmp_path / "out", follow=True), store, [0, 1, 2, 3], index, None)
    acc = OneProcess()
    sched.decide(0, acc)
    n0 = len(sched.refs(0))
    commit(small_store, store_path, 2)
    sched.decide(1, acc)
    sched.decide(1, acc)  # decided once: asking again changes nothing
    commit(small_store, store_path, 3)
    sched.decide(2, acc)
    assert [sched.shards(e) for e in range(3)] == [(0, 1), (0, 1, 2), (0, 1, 2, 3)]
    assert n0 < len(sched.refs(1)) < len(sched.refs(2))
    assert set(sched.refs(1).shard.tolist()) == {0, 1, 2}
    assert json.loads((tmp_path / "out" / FILE).read_text())["epochs"] == ["0-1", "0-2", "0-3"]
    assert sched.unread(2) == ""
    assert sched.unread(1) == (
        "shards 3 of --shards never trained on: 3 committed after the last epoch run (epoch 1) began"
    )
    with pytest.raises(IndexError):  # an epoch is never formed before its shards are decided
        sched.shards(3)


def test_a_saved_schedule_is_replayed_not_looked_up(small_store, tmp_path):
    """--resume of a followed run: the epochs it saved keep their shards though more are committed now."""
    store = HiddenStore(str(small_store))
    index, _ = index_file.load(store)
    saved = Position(1, ((3, 8),), schedule=("0-1", "0-2")).to_json()
    position = Position.from_json(json.loads(json.dumps(saved)))
    (tmp_path / "out").mkdir()
    sched = schedule_of(
        config(small_store, tmp_path / "out", follow=True), store, [0, 1, 2, 3], index, position.schedule
    )
    for e in (0, 1, 2):
        sched.decide(e, OneProcess())
    assert [sched.shards(e) for e in range(3)] == [(0, 1), (0, 1, 2), (0, 1, 2, 3)]
    replay = ShardSchedule(config(small_store, tmp_path), store, [0, 1, 2, 3], index.arrays, [(0,), (0, 2)], "replay")
    assert [replay.shards(e) for e in range(4)] == [(0,), (0, 2), (0, 2), (0, 2)]  # past its end: the last entry
    assert Position.from_json({"epoch": 2, "remaining": None}).schedule is None  # a checkpoint before --follow


def test_follow_waits_for_enough_shards_to_begin(small_store, tmp_path):
    store_path = growing(small_store, tmp_path / "grow.zarr", first=0)
    store = HiddenStore(str(store_path))
    index, _ = index_file.load(store)
    (tmp_path / "out").mkdir()
    sched = schedule_of(config(store_path, tmp_path / "out", follow=True), store, [0, 1, 2, 3], index, None)
    said = []
    late = threading.Timer(0.3, commit, (small_store, store_path, 1))
    late.start()
    sched.wait_for_start(OneProcess(), lambda refs: len(refs) > 0, said.append)
    late.join()
    assert sched.epochs == [(1,)] and said and "0 of the 4 shards" in said[0]


def test_schedule_mistakes_are_refused(small_store, tmp_path):
    with pytest.raises(ConfigError, match="--max-steps"):
        TrainConfig.of(store="s", shards="0-3", follow=True)
    with pytest.raises(ConfigError, match="--shards"):
        TrainConfig.of(store="s", max_steps=3, shard_schedule="x.json")
    with pytest.raises(ConfigError, match="--shard-schedule"):
        TrainConfig.of(store="s", shards="0-3", max_steps=3, follow=True, shard_schedule="x.json")
    store = HiddenStore(str(small_store))
    index, _ = index_file.load(store)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"epochs": ["0-1", "2-3"]}))
    with pytest.raises(ConfigError, match="outside --shards 0-1"):
        schedule_of(
            TrainConfig.of(store=str(small_store), shards="0-1", max_steps=3, shard_schedule=str(bad)),
            store,
            [0, 1],
            index,
            None,
        )
    partial = growing(small_store, tmp_path / "grow.zarr")
    with pytest.raises(NotCommitted, match="shards 2-3"):
        schedule_of(
            TrainConfig.of(store=str(partial), shards="0-3", max_steps=3, shard_schedule=str(bad)),
            HiddenStore(str(partial)),
            [0, 1, 2, 3],
            index_file.load(HiddenStore(str(partial)))[0],
            None,
        )


def test_a_followed_run_equals_its_schedule_replayed(small_store, tmp_path):
    """A store growing under a running trainer (shards committed while it trains), the trainer interrupted and
    resumed on the way, gives the same losses and weights as a run of its recorded schedule on the finished store."""
    store = growing(small_store, tmp_path / "grow.zarr")
    followed, replayed = tmp_path / "followed", tmp_path / "replayed"
    common = ["--shards", "0-3", "--max-steps", 60, "--save-every", 20, *TINY]

    def epochs() -> int:
        try:
            return len(json.loads((followed / FILE).read_text())["epochs"])
        except (FileNotFoundError, ValueError):
            return 0

    def committer() -> None:  # shard 2 once the trainer has decided its first epoch, shard 3 after its second
        for shard, after in ((2, 1), (3, 2)):
            while epochs() < after:
                time.sleep(0.02)
            commit(small_store, store, shard)

    thread = threading.Thread(target=committer, daemon=True)
    thread.start()
    r = train(["--store", store, "--out", followed, "--follow", "--follow-poll", 0.05, *common], stop_after=20)
    assert r.returncode == 130, r.stderr
    r = train(["--store", store, "--out", followed, "--follow", "--follow-poll", 0.05, "--resume", *common])
    assert r.returncode == 0, r.stderr
    thread.join(timeout=60)
    schedule = json.loads((followed / FILE).read_text())["epochs"]
    assert schedule[0] == "0-1" and "0-3" in schedule, schedule  # it trained while the store grew
    saved = json.loads((followed / "step-40" / "trainer_state.json").read_text())["position"]["schedule"]
    assert schedule[: len(saved)] == saved

    records = [json.loads(x) for x in (followed / "metrics.jsonl").read_text().splitlines()]
    walked = [x["epoch"] for x in records if x["split"] == "train"]  # epochs of their own sizes, walked
    assert walked == sorted(walked) and len(schedule) - 2 < walked[-1] <= len(schedule), (walked, schedule)

    r = train(["--store", small_store, "--out", replayed, "--shard-schedule", followed / FILE, *common])
    assert r.returncode == 0, r.stderr
    assert losses(replayed) == losses(followed) and len(losses(followed)) == 60
    a, b = checkpoint.load(followed / "final")[1], checkpoint.load(replayed / "final")[1]
    assert all(torch.equal(a[k], b[k]) for k in a)


def last_line(r) -> str:
    return r.stdout.strip().splitlines()[-1]


def test_the_last_line_names_exactly_the_shards_no_epoch_run_read_and_why(small_store, tmp_path):
    """A followed run ends with its first epoch, while its loader, reading ahead, already decided the
    second with shard 2 (committed meanwhile): the run never read shards 2 and 3, and its last line
    says so and why; its schedule replayed on the finished store says the same, in the schedule's terms."""
    store = growing(small_store, tmp_path / "grow.zarr")  # shards 0-1 committed, 2-3 not yet
    followed, replayed = tmp_path / "followed", tmp_path / "replayed"
    data = TrainConfig.of(store=str(store), shards="0-3", max_steps=1, batch_size=1).data
    steps = epoch_length(data, refs_of(index_file.load(HiddenStore(str(store)))[0].arrays, [0, 1], data.max_length), 0)
    assert steps > 4  # the loader's worker reads 4 batches ahead: it decides epoch 1 before epoch 0 ends

    def committer() -> None:  # shard 2 once the trainer has decided its first epoch
        while not (followed / FILE).exists():
            time.sleep(0.02)
        commit(small_store, store, 2)

    thread = threading.Thread(target=committer, daemon=True)
    thread.start()
    common = ["--shards", "0-3", "--max-steps", steps, *TINY, "--batch-size", 1]
    r = train(["--store", store, "--out", followed, "--follow", "--follow-poll", 0.05, *common])
    thread.join(timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads((followed / FILE).read_text())["epochs"][:2] == ["0-1", "0-2"]  # epoch 1 decided, never run
    assert last_line(r).endswith(
        "; shards 2-3 of --shards never trained on: 2 committed after the last epoch run "
        "(epoch 0) began, 3 not committed when the run ended"
    ), last_line(r)

    r = train(["--store", small_store, "--out", replayed, "--shard-schedule", followed / FILE, *common])
    assert r.returncode == 0, r.stderr
    assert last_line(r).endswith(
        "; shards 2-3 of --shards never trained on: 2 listed by --shard-schedule only in "
        "epochs this run did not reach, 3 in none of its epochs"
    ), last_line(r)
