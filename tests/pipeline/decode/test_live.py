"""Live speculative decoding with the tiny target accepts exactly what replay accepts (fp32)."""

from stages.evaluate.config import EvalConfig
from stages.evaluate.run import run


def test_live_equals_replay_on_every_prompt(small_store, trained_drafter, tmp_path):
    from pipeline import TINY_TARGET

    rep = run(
        EvalConfig(
            store=str(small_store),
            checkpoints=(str(trained_drafter),),
            shards="0-3",
            out=str(tmp_path / "rep"),
            ddtree=(),
            dtype="fp32",
            live=True,
            live_prompts=None,
            target=str(TINY_TARGET),
        ),
        log=lambda m: None,
    )
    r = rep["checkpoints"][0]
    live = r["live"]
    assert live["prompts"] == r["prompts"] > 5
    assert live["prompts_equal_to_replay"] == live["prompts"]  # the same (accepted, committed) every round
    assert live["completions_equal_to_store"] == live["prompts"]  # and the stored greedy completion
    assert live["tau"] == r["tau"] and live["rounds"] == r["rounds"]
    assert sum(r["histogram"][1:]) > 0  # some drafts were accepted: not the trivial all-rejected case
    assert live["tokens_per_s"] > 0 and live["target_only_tokens_per_s"] > 0


def test_live_runs_on_the_first_prompts_of_the_sample_by_default(small_store, trained_drafter, tmp_path):
    from pipeline import TINY_TARGET

    rep = run(
        EvalConfig(
            store=str(small_store),
            checkpoints=(str(trained_drafter),),
            shards="0-3",
            out=str(tmp_path / "rep"),
            ddtree=(),
            live=True,
            live_prompts=3,
            target=str(TINY_TARGET),
        ),
        log=lambda m: None,
    )
    r = rep["checkpoints"][0]
    assert r["live"]["prompts"] == rep["sample"]["live_prompts"] == 3 < r["prompts"]
    assert "first 3 prompts of the sample" in (tmp_path / "rep" / "report.md").read_text()


def test_live_drafts_equal_replay_drafts_with_a_context_sensitive_drafter(small_store, tmp_path):
    """A random drafter with large weights: its drafts depend on the context states, so equal drafts
    every round mean live fed the drafter exactly the states replay read from the store."""
    import torch

    from pipeline import TINY_TARGET
    from pipeline.decode import live
    from pipeline.drafter.model import Drafter
    from pipeline.target import loading
    from pipeline.target.verifier import LiveTarget
    from stages.evaluate.prompts import Prompts
    from stages.train.config import TrainConfig
    from stages.train.setup import drafter_config
    from store.hidden_store import HiddenStore
    from tests.pipeline.decode import reference_replay as replay

    store = HiddenStore(str(small_store))
    attrs = store.attrs
    dc, _ = drafter_config(TrainConfig.of(num_layers=2, block_size=8), attrs, None)
    m = Drafter(dc, store.embedding("embed_tokens").float(), store.embedding("lm_head").float())
    m.init_weights(torch.Generator().manual_seed(3), std=0.3)
    lt = LiveTarget(loading.load(str(TINY_TARGET), "cpu", attrs.dtype, "auto"), list(attrs.taps))
    compared = 0
    prompts = Prompts(store, [0, 1], None, seed=0)
    for s in prompts.read(prompts.refs):
        limit = attrs.compat.completion_limit(s.prompt_len)
        lv = live.speculative(m, lt, s.tokens[: s.prompt_len], limit, set(attrs.eos_token_ids))
        rp = replay.replay(m, s, keep_drafts=True)
        assert lv.rounds == rp.rounds and len(lv.drafts) == len(rp.drafts)
        for a, b in zip(lv.drafts, rp.drafts):
            assert a == b[: len(a)]
            compared += len(a)
    assert compared > 50
