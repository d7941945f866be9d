"""Validation during training (stages/train/validation.py): the replayed tau is the evaluator's."""

import json

from stages.train.samples import index_samples
from stages.train.validation import replay_sums
from store.hidden_store import HiddenStore
from tests.processes import TINY, train


def test_replayed_tau_is_what_evaluate_reports(small_store, trained_drafter, tmp_path):
    """The same drafter (the checkpoint's weights in fp32) on every held-out prompt: the training
    validation's replay gives evaluate.py --dtype fp32's chain tau and pooled tau."""
    from pipeline.drafter import checkpoint
    from pipeline.drafter.model import Drafter
    from stages.evaluate.config import EvalConfig
    from stages.evaluate.run import run

    store = HiddenStore(str(small_store))
    config, tensors, _ = checkpoint.load(trained_drafter)
    m = Drafter(config, store.embedding("embed_tokens").float(), store.embedding("lm_head").float())
    checkpoint.load_into(m, {k: v.float() for k, v in tensors.items()})
    m.eval()
    tau_sum, prompts, tokens, rounds = replay_sums(m, store, index_samples(store, [3], 4096)).tolist()
    rep = run(
        EvalConfig(
            store=str(small_store),
            checkpoints=(str(trained_drafter),),
            shards="3",
            max_prompts=None,
            ddtree=(),
            dtype="fp32",
            out=str(tmp_path / "rep"),
        ),
        log=lambda line: None,
    )
    r = rep["checkpoints"][0]
    assert prompts == r["prompts"] > 1 and rounds == r["rounds"] and tokens == r["tokens"]
    assert abs(tau_sum / prompts - r["tau"]) < 1e-12 and abs(tokens / rounds - r["tau_pooled"]) < 1e-12
    assert r["tau"] > 1.05  # the trained drafter accepts drafts: the figure says something


def test_eval_records_carry_the_replayed_tau(small_store, tmp_path):
    out = tmp_path / "run"
    r = train(
        [
            "--store",
            small_store,
            "--out",
            out,
            "--max-steps",
            2,
            "--eval-shards",
            "3",
            "--eval-replay-prompts",
            "3",
            *TINY,
        ]
    )
    assert r.returncode == 0, r.stderr
    evals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    assert "tau_replay" not in evals[0]  # step 0 of a fresh drafter: not replayed (tau ~1 at the most rounds)
    assert evals[1]["replay_prompts"] == 3 and 1 <= evals[1]["tau_replay"] <= 16
    assert "replay tau" in r.stdout
    off = tmp_path / "off"
    r = train(
        [
            "--store",
            small_store,
            "--out",
            off,
            "--max-steps",
            1,
            "--eval-shards",
            "3",
            "--eval-replay-prompts",
            "0",
            *TINY,
        ]
    )
    assert r.returncode == 0 and "tau_replay" not in (off / "metrics.jsonl").read_text()


def test_validation_replays_through_the_runs_node_cache(small_store, tmp_path, monkeypatch):
    """On an object store with --cache-dir, the replayed tau reads its samples through the run's node
    cache, as the loader does (it opened the store without the cache, every validation)."""
    from stages.train import validation
    from stages.train.config import TrainConfig
    from stages.train.run import run
    from store.io.node_cache import NodeCache
    from tests.store.io.test_node_cache import upload

    fetched, replaying = [], []  # for every fetch through a node cache: whether validation's replay asked
    real_fetch, real_sums = NodeCache.fetch, validation.replay_sums

    def fetch(self, fs, ranges, local_of):
        fetched.append(bool(replaying))
        return real_fetch(self, fs, ranges, local_of)

    def replay_sums(*args):
        replaying.append(True)
        try:
            return real_sums(*args)
        finally:
            replaying.clear()

    monkeypatch.setattr(NodeCache, "fetch", fetch)
    monkeypatch.setattr(validation, "replay_sums", replay_sums)
    run(
        TrainConfig.of(
            store=upload(small_store),
            out=str(tmp_path / "run"),
            shards="0-2",
            eval_shards="3",
            eval_replay_prompts=2,
            max_steps=1,
            save_every=0,
            workers=0,
            threads=1,
            num_layers=1,
            anchors=16,
            batch_size=2,
            cache_dir=str(tmp_path / "cache"),
            cache_size=1 << 30,
        ),
        log=lambda m: None,
    )
    assert False in fetched and True in fetched  # the loader's reads and the replay's, both through the cache
