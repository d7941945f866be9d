"""`pipeline extract --final-state`: the target's state after its final norm, stored per token beside the
taps, checked per shard as it is written (a capture one position off, or taken before the norm, stops
the run), rechecked by `pipeline verify`, shown by `pipeline info`; stores without it read as before."""

import dataclasses
import json
import shutil

import pytest
import torch

from pipeline.errors import TargetError
from pipeline.target import final_state
from pipeline.target.model import Target
from stages.extract.config import ExtractConfig
from stages.extract.run import run
from stages.extract.summary import render as render_run
from store.errors import ConfigError, StoreCorrupt, StoreMismatch
from store.format import fp8_codec, layout
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader
from store.summary import render, summarize
from tests.conftest import SMALL
from tests.targets import bf16_close, reference_states


def config(path, dataset, **kw) -> ExtractConfig:
    settings = {"shards": "0-3", "num_shards": 4, **SMALL, "final_state": True, **kw}
    return ExtractConfig(store=str(path), dataset=str(dataset), **settings)


def samples(path, **kw):
    store = HiddenStore(str(path))
    for shard in store.committed():
        reader = ShardReader(store, shard)
        yield from (reader.read(i, **kw) for i in range(len(reader)))


def verify_cli(path):
    from click.testing import CliRunner

    from pipeline.cli import cli

    return CliRunner().invoke(cli, ["verify", str(path), "--processes", "1"])


def test_the_final_state_is_hugging_faces_last_hidden_state_after_the_norm(final_store, small_store, target):
    """hidden_states[-1] (after the final norm) up to bf16 rounding, never the last layer's output before
    it; the taps are the small store's, bit for bit."""
    got = list(samples(final_store, final_state=True))
    assert len(got) == 14
    for s, plain in zip(got, samples(small_store), strict=True):
        assert torch.equal(s.hidden, plain.hidden) and torch.equal(s.tokens, plain.tokens)
        hs = reference_states(target, s.tokens.tolist())
        assert s.final_state.shape == (len(s.tokens), 128) and s.final_state.dtype == torch.bfloat16
        assert bf16_close(s.final_state, hs[-1][0]), s.row_id
        assert not bf16_close(s.final_state, hs[-2][0]), s.row_id  # the output of the last layer, pre-norm
    assert all(s.final_state is None for s in samples(final_store))  # read only when asked for


def test_the_store_records_it_and_its_check(final_store, small_store):
    store, plain = HiddenStore(str(final_store)), HiddenStore(str(small_store))
    assert store.attrs.compat.final_state is True and store.layout.final_state
    assert store.attrs.compat.differences(plain.attrs.compat) == {"final_state": (True, None)}
    assert store.attrs.compat.conditioning() == plain.attrs.compat.conditioning()  # the taps are the same
    assert store.attrs.fingerprint != plain.attrs.fingerprint
    for shard, record in store.committed().items():
        c = record.final_state
        assert c["tokens"] == record.completion_tokens  # the state before each completion token
        assert c["matches"] == c["tokens"] and c["normed"] == c["states"] == record.tokens  # fp32 target: all
        assert record.agreement == {"matches": c["matches"], "tokens": c["tokens"]}
        assert record.shapes[layout.FINAL_STATE] == [record.tokens, 128]
    s = summarize(store)
    assert s["final_state"]["rate"] == 1.0 and s["final_state"]["shards_checked"] == 4
    text = render(s)
    assert "final state  stored per token; argmax of lm_head(final state) is the next token for 100.00%" in text
    assert "bf16 states, with the final state" in text
    assert "final state" not in render(summarize(plain))


def test_verify_rechecks_the_rate_from_the_stored_states_and_lm_head(final_store):
    r = verify_cli(final_store)
    assert r.exit_code == 0, r.output
    assert "final state: argmax of lm_head(stored final state) is the next token for 100.00%" in r.output
    totals, problems = final_state.recheck(HiddenStore(str(final_store)), [0, 1, 2, 3])
    assert totals["rate"] == 1.0 and not problems


def test_an_old_store_reads_as_before_and_has_no_final_state(small_store):
    store = HiddenStore(str(small_store))
    assert store.attrs.compat.final_state is None and not store.layout.final_state
    assert "final_state" not in json.loads((small_store / "zarr.json").read_text())["attributes"]["compat"]
    reader = ShardReader(store, 0)
    assert not reader.has_final_state and reader.read(0).final_state is None
    with pytest.raises(StoreMismatch, match=r"made without --final-state, so shard 0 holds no final states"):
        reader.read(0, final_state=True)


def test_a_rerun_that_changes_the_flag_is_refused(final_store, tmp_path, small_dataset):
    shutil.copytree(final_store, tmp_path / "s.zarr")
    with pytest.raises(StoreMismatch, match=r"final_state: store has true, this run has null"):
        run(config(tmp_path / "s.zarr", small_dataset, final_state=False), log=lambda m: None)
    assert run(config(tmp_path / "s.zarr", small_dataset), log=lambda m: None)["shards_skipped"] == [0, 1, 2, 3]


def test_an_old_store_takes_no_final_states(small_store, tmp_path, small_dataset):
    shutil.copytree(small_store, tmp_path / "s.zarr")
    with pytest.raises(StoreMismatch, match=r"final_state: store has null, this run has true"):
        run(config(tmp_path / "s.zarr", small_dataset), log=lambda m: None)


def test_refused_with_capture_vllm_or_without_the_agreement_forward():
    with pytest.raises(ConfigError, match=r"--final-state.*goes with --capture transformers.*pre-norm"):
        ExtractConfig(final_state=True, capture="vllm")
    with pytest.raises(ConfigError, match=r"--final-state.*drop --no-agreement"):
        ExtractConfig(final_state=True, agreement=False)


def wrong_capture(monkeypatch, how: str) -> None:
    """Target.capture handing back final states one position late ("next"), early ("previous") or the last
    layer's output before the final norm ("pre-norm"): what a wrong capture would store."""
    capture = Target.capture

    def wrong(self, seqs, taps, prompt_lens=None, *, final_state=False, **kw):
        if not final_state:
            return capture(self, seqs, taps, prompt_lens, **kw)
        if how == "pre-norm":
            hidden = capture(self, seqs, [*taps, self.num_layers - 1], **kw)  # [T, n_taps + 1, H]
            return hidden[:, :-1].contiguous(), hidden[:, -1].contiguous()
        hidden, final = capture(self, seqs, taps, final_state=True, **kw)
        return hidden, torch.roll(final, -1 if how == "next" else 1, dims=0)

    monkeypatch.setattr(Target, "capture", wrong)


@pytest.mark.parametrize(
    "how,refusal",
    [
        ("next", r"shard 0: argmax of lm_head\(final state\) is the next reference token for \d+\.\d% of \d+"),
        ("previous", r"shard 0: argmax of lm_head\(final state\) is the next reference token for \d+\.\d% of \d+"),
        ("pre-norm", r"shard 0: only \d+ of \d+ final states \(\d+\.\d%\) have unit RMS under the target's final"),
    ],
)
def test_a_wrong_capture_stops_the_run_naming_the_shard(monkeypatch, tmp_path, small_dataset, how, refusal):
    wrong_capture(monkeypatch, how)
    path = tmp_path / "s.zarr"
    with pytest.raises(TargetError, match=refusal) as e:
        run(config(path, small_dataset, shards="0"), log=lambda m: None)
    assert "\n" not in str(e.value) and "not committed" in str(e.value)
    assert HiddenStore(str(path)).committed() == {}


def test_verify_fails_a_store_whose_final_states_are_one_position_off(monkeypatch, tmp_path, small_dataset):
    """Written with the extraction's check switched off (here only), the off-by-one states are found by verify."""
    wrong_capture(monkeypatch, "next")
    monkeypatch.setattr(final_state, "require", lambda *a, **k: None)
    path = tmp_path / "s.zarr"
    run(config(path, small_dataset, shards="0-1"), log=lambda m: None)
    r = verify_cli(path)
    assert r.exit_code == 1
    assert "CORRUPT shard 0: final_state: argmax of lm_head(stored final state) is the next token for" in r.output
    assert "CORRUPT shard 1: final_state" in r.output


def test_dataset_responses_report_the_rate_without_enforcing_it(tmp_path, small_dataset):
    path = tmp_path / "s.zarr"
    summary = run(config(path, small_dataset, shards="0-1", responses="dataset"), log=lambda m: None)
    assert summary["agreement"]["rate"] < final_state.MIN_RATE  # human responses: not the target's argmax
    f = summarize(HiddenStore(str(path)))["final_state"]
    assert f["rate"] == summary["agreement"]["rate"] == summary["final_state"]["rate"] and f["normed"] == f["states"]
    assert "final state: stored per token; argmax of lm_head(final state)" in render_run(summary)
    r = verify_cli(path)
    assert r.exit_code == 0 and "reported only: not greedy references" in r.output


def test_an_fp8_store_keeps_its_final_states_in_fp8(tmp_path, small_dataset, final_store):
    path = tmp_path / "fp8.zarr"
    run(config(path, small_dataset, shards="0-1", hidden_format="fp8"), log=lambda m: None)
    meta = json.loads((path / "shards/00000/final_state/zarr.json").read_text())
    assert meta["codecs"][0]["configuration"]["codecs"][1]["name"] == "dflash.fp8_e4m3"
    store = HiddenStore(str(path))
    for shard, record in store.committed().items():
        assert record.final_state["matches"] >= final_state.MIN_RATE * record.final_state["tokens"]
        exact, rounded = ShardReader(HiddenStore(str(final_store)), shard), ShardReader(store, shard)
        for i in range(len(rounded)):
            want = fp8_codec.quantize(exact.read(i, final_state=True).final_state)
            assert torch.equal(rounded.read(i, final_state=True).final_state, want)


def test_verify_names_a_damaged_or_missing_final_state_array(final_store, tmp_path):
    from store.verify import verify

    damaged = tmp_path / "d.zarr"
    shutil.copytree(final_store, damaged)
    chunk = sorted(p for p in (damaged / "shards/00001/final_state").rglob("c*") if p.is_file())[0]
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x5A
    chunk.write_bytes(bytes(data))
    problems = verify(HiddenStore(str(damaged))).problems
    assert list(problems) == [1] and problems[1][0].startswith("final_state: unreadable chunk (ValueError: Stored and")
    reader = ShardReader(HiddenStore(str(damaged)), 1)
    with pytest.raises(StoreCorrupt, match=r"final_state.*crc32c.*shard 1, sample \d+"):
        for i in range(len(reader)):
            reader.read(i, final_state=True)
    record = HiddenStore(str(final_store)).commit_record(2)
    without = dataclasses.replace(
        record, shapes={k: v for k, v in record.shapes.items() if k != layout.FINAL_STATE}, final_state=None
    )
    from store.verify import check_shard

    store = HiddenStore(str(final_store))
    problems, _ = check_shard(store, 2, without, 5, 128)
    assert problems == [
        "final_state: not in the shard's commit file, though the store keeps a final state per token "
        "(written by a version without --final-state)"
    ]


def test_a_final_state_with_nan_is_a_nonfinite_row(monkeypatch, tmp_path, small_dataset):
    """NaN in a row's final state only (its taps finite): the run stops naming the row, or with
    --skip-nonfinite leaves it out and counts it; the rows kept are checked and stored as ever."""
    capture = Target.capture

    def nan_in_first_row(self, seqs, taps, prompt_lens=None, *, final_state=False, **kw):
        if not final_state:  # the start-up probe
            return capture(self, seqs, taps, prompt_lens, **kw)
        hidden, final = capture(self, seqs, taps, final_state=True, **kw)
        final = final.clone()
        final[len(seqs[0]) - 1] = float("nan")
        return hidden, final

    monkeypatch.setattr(Target, "capture", nan_in_first_row)
    with pytest.raises(TargetError, match=r"shard 0: the target's hidden states hold NaN or Inf for dataset row"):
        run(config(tmp_path / "a.zarr", small_dataset, shards="0"), log=lambda m: None)
    summary = run(config(tmp_path / "b.zarr", small_dataset, shards="0", skip_nonfinite=True), log=lambda m: None)
    record = HiddenStore(str(tmp_path / "b.zarr")).commit_record(0)
    nonfinite = record.skipped["nonfinite"]
    assert nonfinite == summary["skipped"]["nonfinite"] >= 1 and record.samples + nonfinite == 3  # a batch's first
    assert record.samples >= 1
    assert record.final_state["states"] == record.tokens == record.shapes[layout.FINAL_STATE][0]
    assert record.final_state["matches"] == record.final_state["tokens"] > 0
