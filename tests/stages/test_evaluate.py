"""evaluate.py: the report, conditioning checks, released checkpoints, one-line errors."""

import json
import os
import subprocess
import sys

import pytest
import torch

from pipeline.drafter import checkpoint
from pipeline.drafter.config import TrainingRecord
from pipeline.errors import DrafterError
from stages.evaluate.config import EvalConfig
from stages.evaluate.run import run
from store.errors import ConfigError
from store.hidden_store import HiddenStore
from tests.conftest import REPO
from tests.drafters import write_released


def our_checkpoint(store_path, directory, **record):
    from pipeline.drafter.model import Drafter
    from stages.train.config import TrainConfig
    from stages.train.setup import drafter_config

    store = HiddenStore(str(store_path))
    dc, _ = drafter_config(TrainConfig.of(num_layers=2), store.attrs, None)
    m = Drafter(dc, store.embedding("embed_tokens"), store.embedding("lm_head"))
    m.init_weights(torch.Generator().manual_seed(0))
    info = {"store_fingerprint": store.attrs.fingerprint, "train_shards": "0-2", "eval_shards": "3", "step": 7}
    checkpoint.save(directory, dc, m.state_dict(), TrainingRecord(**{**info, **record}))
    return directory


def evaluate(store, tmp_path, *cks, **over):
    return run(
        EvalConfig(
            store=str(store), checkpoints=tuple(map(str, cks)), out=str(tmp_path / "rep"), ddtree=(1, 8), **over
        ),
        log=lambda m: None,
    )


def test_report_schema_and_files(small_store, tmp_path):
    ck = our_checkpoint(small_store, tmp_path / "ck")
    rep = evaluate(small_store, tmp_path, ck)
    assert rep["shards"] == "3" and rep["warnings"] == []  # the checkpoint's held-out shards by default
    r = rep["checkpoints"][0]
    for key in ("tau", "tau_pooled", "histogram", "per_slot", "ddtree", "per_prompt"):
        assert key in r, key
    assert len(r["histogram"]) == 16 and len(r["per_slot"]) == 15 and set(r["ddtree"]) == {"1", "8"}
    assert 1 <= r["tau_pooled"] <= 16 and 1 <= r["ddtree"]["1"] <= 2  # budget 1: at most 2 tokens per round
    assert r["check"] == "store fingerprint matches"
    assert sum(r["histogram"]) == r["rounds"] == sum(p["rounds"] for p in r["per_prompt"])
    for name in ("report.json", "report.md", "histogram.png", "per_slot.png"):
        assert (tmp_path / "rep" / name).stat().st_size > 0
    assert json.loads((tmp_path / "rep" / "report.json").read_text())["checkpoints"][0]["tau"] == r["tau"]
    assert "mean over prompts" in (tmp_path / "rep" / "report.md").read_text()


def test_other_store_is_refused_unless_allowed(small_store, tmp_path):
    ck = our_checkpoint(small_store, tmp_path / "ck", store_fingerprint="0" * 64)
    with pytest.raises(DrafterError, match="not trained on this store's conditioning.*store fingerprint"):
        evaluate(small_store, tmp_path, ck)
    rep = evaluate(small_store, tmp_path, ck, allow_mismatch=True)
    assert rep["warnings"][0].startswith("MISMATCH allowed")
    assert (tmp_path / "rep" / "report.md").read_text().splitlines()[2].startswith("> **WARNING:** MISMATCH")


def test_another_stores_data_of_the_same_conditioning_is_replayed(small_store, tmp_path):
    """A checkpoint trained on another store: accepted when that store's conditioning (target,
    kernels, dtype, taps, tokenizer) is this one's, refused when it is not."""
    same = HiddenStore(str(small_store)).attrs.compat.conditioning()
    ck = our_checkpoint(
        small_store, tmp_path / "ck", store_fingerprint="0" * 64, store_conditioning=same, store_placement="2" * 64
    )
    rep = evaluate(small_store, tmp_path, ck)
    assert rep["warnings"] == [] and rep["checkpoints"][0]["check"].startswith("conditioning matches")
    other = our_checkpoint(small_store, tmp_path / "other", store_fingerprint="0" * 64, store_conditioning="1" * 64)
    with pytest.raises(DrafterError, match="not trained on this store's conditioning.*store fingerprint"):
        evaluate(small_store, tmp_path, other)


def test_another_store_replays_its_own_shards_not_the_training_stores_numbers(small_store, tmp_path):
    """A checkpoint of another store of the same conditioning (the benchmark-store workflow), trained on
    shards 0-5 of an 8-shard store and holding out 6-7: on this 4-shard store it replays this store's
    shards, --shards when given, else every committed one, and says which and why; the training
    store's shard numbers are neither applied nor checked against this store's."""
    same = HiddenStore(str(small_store)).attrs.compat.conditioning()
    ck = our_checkpoint(
        small_store,
        tmp_path / "ck",
        store_fingerprint="0" * 64,
        store_conditioning=same,
        train_shards="0-5",
        eval_shards="6-7",
    )
    lines = []
    rep = run(
        EvalConfig(store=str(small_store), checkpoints=(str(ck),), out=str(tmp_path / "rep"), ddtree=(1,)),
        log=lines.append,
    )
    assert (rep["shards"], rep["shards_chosen_by"], rep["warnings"]) == ("0-3", "committed", [])
    assert rep["shards_reason"].startswith("every committed shard of this store; ")
    assert "trained on another store (fingerprint 000000000000), whose held-out shards 6-7" in rep["shards_reason"]
    assert f"replaying shards 0-3 of {small_store}: every committed shard of this store" in "\n".join(lines)
    assert f"Shards replayed: {rep['shards_reason']}." in (tmp_path / "rep" / "report.md").read_text()
    rep = evaluate(small_store, tmp_path, ck, shards="0-1", force=True)
    assert (rep["shards"], rep["shards_chosen_by"], rep["shards_reason"]) == ("0-1", "--shards", "given by --shards")
    assert rep["warnings"] == []  # its training shards 0-5 number the other store's prompts: no overlap claimed


def test_a_checkpoint_of_a_store_that_did_not_record_its_conv1d_kernel_is_replayed_with_a_warning(
    small_store, tmp_path
):
    """Trained on a store made before compat.conv1d was recorded, otherwise of this conditioning:
    replayed, the kernel named in a warning; this store's own digest, or the unrecorded one with
    another difference, as before."""
    import dataclasses

    compat = HiddenStore(str(small_store)).attrs.compat
    assert compat.conv1d == "torch"
    old = dataclasses.replace(compat, conv1d=None)
    ck = our_checkpoint(
        small_store,
        tmp_path / "ck",
        store_fingerprint="0" * 64,
        store_conditioning=old.conditioning(),
        store_placement=compat.placement(),
    )
    rep = evaluate(small_store, tmp_path, ck)
    assert rep["checkpoints"][0]["check"].startswith("conditioning matches")
    assert len(rep["warnings"]) == 1 and "did not record its conv1d kernel" in rep["warnings"][0]
    assert "made with torch" in rep["warnings"][0]
    other = our_checkpoint(
        small_store,
        tmp_path / "other",
        store_fingerprint="0" * 64,
        store_conditioning=dataclasses.replace(old, taps=(1, 2)).conditioning(),
    )
    with pytest.raises(DrafterError, match="not trained on this store's conditioning"):
        evaluate(small_store, tmp_path, other)


def test_a_store_of_the_same_prompts_replays_the_held_out_shards(small_store, tmp_path):
    """Another store that holds the same prompts under the same shard numbers (the placement the
    checkpoint recorded: the bf16 store beside an fp8 one) replays the checkpoint's held-out shards;
    one of the same store as ever; an older checkpoint without a placement is warned about."""
    attrs = HiddenStore(str(small_store)).attrs
    same = dict(store_fingerprint="0" * 64, store_conditioning=attrs.compat.conditioning())
    ck = our_checkpoint(small_store, tmp_path / "ck", store_placement=attrs.compat.placement(), **same)
    rep = evaluate(small_store, tmp_path, ck)
    assert (rep["shards"], rep["shards_chosen_by"]) == ("3", "held-out")
    assert "that holds the same prompts under the same shard numbers" in rep["shards_reason"]
    rep = evaluate(small_store, tmp_path, our_checkpoint(small_store, tmp_path / "own"), force=True)
    assert (rep["shards"], rep["shards_chosen_by"]) == ("3", "held-out") and rep["shards_reason"].endswith(
        "trained on this store"
    )
    old = evaluate(small_store, tmp_path, our_checkpoint(small_store, tmp_path / "old", **same), force=True)
    assert old["shards"] == "0-3" and "pass --shards 3 to replay only its held-out ones" in old["warnings"][0]


def test_a_drafter_trained_on_fp8_states_is_replayed_on_bf16_ones_with_a_warning(small_store, tmp_path):
    """The cross-format evaluation (how an fp8-trained drafter is served): allowed when the conditioning
    differs only in the hidden format, named in the check and the warnings; any other difference
    besides it is still refused."""
    import dataclasses

    compat = HiddenStore(str(small_store)).attrs.compat
    ck = our_checkpoint(
        small_store,
        tmp_path / "ck",
        store_fingerprint="0" * 64,
        store_conditioning=compat.as_format("fp8").conditioning(),
        store_placement=compat.placement(),
    )
    rep = evaluate(small_store, tmp_path, ck)
    assert rep["checkpoints"][0]["check"].startswith("cross-format: trained on fp8 states")
    assert rep["shards"] == "3"  # the fp8 store's held-out shard holds the prompts this store's shard 3 holds
    assert len(rep["warnings"]) == 1 and "trained on fp8 states and is replayed on bf16 states" in rep["warnings"][0]
    assert "cross-format evaluation" in (tmp_path / "rep" / "report.md").read_text()
    taps = dataclasses.replace(compat.as_format("fp8"), taps=(1, 2))
    other = our_checkpoint(
        small_store, tmp_path / "other", store_fingerprint="0" * 64, store_conditioning=taps.conditioning()
    )
    with pytest.raises(DrafterError, match="not trained on this store's conditioning"):
        evaluate(small_store, tmp_path, other)


def test_overlap_with_training_shards_warns(small_store, tmp_path):
    ck = our_checkpoint(small_store, tmp_path / "ck")
    rep = evaluate(small_store, tmp_path, ck, shards="1-3")
    assert any("trained on shards 1-2" in w for w in rep["warnings"])


def test_released_checkpoint_loads_strictly_and_evaluates(small_store, tmp_path):
    attrs = HiddenStore(str(small_store)).attrs
    written = write_released(
        tmp_path / "released", attrs.hidden_size, attrs.vocab_size, attrs.taps, attrs.mask_token_id
    )
    config, tensors, record = checkpoint.load(tmp_path / "released")
    assert record is None and all(torch.equal(tensors[k], v) for k, v in written.items())
    assert config.layer_rule(0) == (True, 64) and config.layer_rule(1) == (False, None)
    rep = evaluate(small_store, tmp_path, tmp_path / "released", our_checkpoint(small_store, tmp_path / "ours"))
    assert rep["shards"] == "3"  # from our checkpoint's record
    assert "store fingerprint not checked" in rep["checkpoints"][0]["check"]
    assert any("carries no store fingerprint" in w for w in rep["warnings"])
    assert [r["prompts"] for r in rep["checkpoints"]] == [rep["checkpoints"][1]["prompts"]] * 2


def test_released_checkpoint_with_other_taps_is_refused(small_store, tmp_path):
    attrs = HiddenStore(str(small_store)).attrs
    write_released(tmp_path / "r", attrs.hidden_size, attrs.vocab_size, [0, 2, 4, 6, 7], attrs.mask_token_id)
    with pytest.raises(DrafterError, match=r"taps: checkpoint \[0, 2, 4, 6, 7\], store \[1, 2, 3, 4, 5\]"):
        evaluate(small_store, tmp_path, tmp_path / "r")


def test_cli_one_line_error(tmp_path, small_store):
    r = subprocess.run(
        [sys.executable, "evaluate.py", "--store", str(small_store), "--checkpoint", str(tmp_path / "no")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no such file" in r.stderr


def test_an_earlier_report_is_replaced_only_with_force(small_store, tmp_path):
    """Like train.py's and export's --out: refused before any replay, in one line naming --out and
    --force; the earlier report is left as it was."""
    ck = our_checkpoint(small_store, tmp_path / "ck")
    evaluate(small_store, tmp_path, ck, max_prompts=2)
    before = (tmp_path / "rep" / "report.json").read_bytes()
    needle = (
        f"--out {tmp_path / 'rep'}: already holds a report (report.json, report.md, histogram.png, "
        "per_slot.png); pass --force to replace it, or choose another --out"
    )
    with pytest.raises(ConfigError) as e:
        evaluate(small_store, tmp_path, ck, max_prompts=3)
    assert str(e.value) == needle
    r = subprocess.run(
        [
            sys.executable,
            "evaluate.py",
            "--store",
            str(small_store),
            "--checkpoint",
            str(ck),
            "--out",
            str(tmp_path / "rep"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr == f"error: {needle}\n"
    assert (tmp_path / "rep" / "report.json").read_bytes() == before
    evaluate(small_store, tmp_path, ck, max_prompts=3, force=True)
    assert json.loads((tmp_path / "rep" / "report.json").read_text())["sample"]["prompts"] == 3
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        run(EvalConfig(store=str(small_store), checkpoints=(str(ck),), out=str(tmp_path / "file")), log=print)


def test_a_second_evaluate_on_one_out_is_refused_naming_the_first(small_store, tmp_path):
    """Two evaluate.py on one --out: the second is refused (a real process, --force or not) while the first holds it,
    instead of both printing `report:` and one report silently replacing the other."""
    from store.io.locks import HOST, LockFile

    ck = our_checkpoint(small_store, tmp_path / "ck")
    (tmp_path / "rep").mkdir()
    first = LockFile(tmp_path / "rep" / ".evaluate.lock")  # where a running evaluate.py holds its --out
    assert first.try_acquire() is None
    r = subprocess.run(
        [
            sys.executable,
            "evaluate.py",
            "--store",
            str(small_store),
            "--checkpoint",
            str(ck),
            "--out",
            str(tmp_path / "rep"),
            "--max-prompts",
            "2",
            "--force",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(
        f"error: --out {tmp_path / 'rep'}: another evaluate.py is writing it (host {HOST}, pid {os.getpid()}, since "
    )
    assert r.stderr.endswith("); wait for it, or choose another --out\n")
    first.release()
    evaluate(small_store, tmp_path, ck, max_prompts=2)
    assert sorted(p.name for p in (tmp_path / "rep").iterdir()) == [
        "histogram.png",
        "per_slot.png",
        "report.json",
        "report.md",
    ]  # the lock released


def test_force_replaces_a_report_and_nothing_else(small_store, store_copy, tmp_path):
    """--out holding a store, a run or files evaluate.py did not write is refused, --force or not, saying what it
    holds; --out inside a store too."""
    from tests.stages.test_export import a_run, tree

    ck = our_checkpoint(small_store, tmp_path / "ck")
    writes = (
        "evaluate.py writes its report into an empty directory or one holding an earlier report; choose another --out"
    )
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "report.json").write_text("{}")
    (notes / "todo.txt").write_text("mine")
    into_a_store = "no command writes its output into a store; choose a directory outside it"
    cases = {
        store_copy: f"is a hidden-state store (zarr.json, shards/, _commits/, ...): {into_a_store}",
        a_run(tmp_path / "run"): f"is a training run (metrics.jsonl, final/, curve.png, ...): {writes}",
        notes: f"holds files evaluate.py did not write (todo.txt): {writes}",
        store_copy / "report": f"lies inside the hidden-state store {store_copy}: {into_a_store}",
    }
    before = {d: tree(d) for d in (store_copy, tmp_path / "run", notes)}
    for out, why in cases.items():
        for force in (False, True):
            with pytest.raises(ConfigError) as e:
                run(
                    EvalConfig(
                        store=str(small_store), checkpoints=(str(ck),), out=str(out), max_prompts=2, force=force
                    ),
                    log=lambda m: None,
                )
            assert str(e.value) == f"--out {out}: {why}"
    assert {d: tree(d) for d in before} == before
    r = subprocess.run(
        [
            sys.executable,
            "evaluate.py",
            "--store",
            str(small_store),
            "--checkpoint",
            str(ck),
            "--out",
            str(tmp_path / "run"),
            "--force",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr == f"error: --out {tmp_path / 'run'}: {cases[tmp_path / 'run']}\n"


def test_a_failed_report_write_leaves_no_directory_it_created(small_store, tmp_path, monkeypatch):
    from stages.evaluate import report

    def full(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "_atomic", full)
    ck = our_checkpoint(small_store, tmp_path / "ck")
    with pytest.raises(OSError, match="No space left"):
        run(
            EvalConfig(
                store=str(small_store),
                checkpoints=(str(ck),),
                out=str(tmp_path / "new" / "rep"),
                max_prompts=2,
                ddtree=(),
            ),
            log=lambda m: None,
        )
    assert not (tmp_path / "new").exists()


def replayed(store, tmp_path, ck, name="rep", **over) -> dict:
    rep = run(
        EvalConfig(
            store=str(store),
            checkpoints=(str(ck),),
            shards="0-3",
            out=str(tmp_path / name),
            ddtree=(4, 16),
            **{"max_prompts": None, **over},
        ),
        log=lambda m: None,
    )
    return rep


def test_batched_replay_gives_every_prompt_the_serial_rounds(small_store, trained_drafter, tmp_path):
    """evaluate.py's batched replay (fp32) against the one-prompt reference, prompt by prompt."""
    from stages.evaluate.conditioning import build, check_checkpoint
    from stages.evaluate.prompts import Prompts
    from tests.pipeline.decode import reference_replay as replay

    rep = replayed(small_store, tmp_path, trained_drafter, dtype="fp32", batch_prompts=5)
    store = HiddenStore(str(small_store))
    m = build(
        check_checkpoint(str(trained_drafter), store, False, []),
        store.embedding("embed_tokens"),
        store.embedding("lm_head"),
        "cpu",
        "fp32",
    )
    prompts = Prompts(store, [0, 1, 2, 3], None, seed=0)
    got = {(p["shard"], p["index"]): p for p in rep["checkpoints"][0]["per_prompt"]}
    assert len(got) == len(prompts) == rep["sample"]["available"] > 5
    for s in prompts.read(prompts.refs):
        p = got[(s.shard, s.index)]
        chain = replay.replay(m, s)
        assert p["rounds"] == len(chain.rounds) and p["tau"] == chain.tau
        assert p["ddtree"] == {str(b): replay.replay(m, s, replay.tree(b)).tau for b in (4, 16)}
    r = rep["checkpoints"][0]
    assert r["histogram"][1] > 0 and r["ddtree"]["16"] > 1.5  # drafts were accepted: not a trivial comparison


def test_bf16_replay_gives_the_fp32_tau_within_two_percent(small_store, trained_drafter, tmp_path):
    fp32 = replayed(small_store, tmp_path, trained_drafter, "a", dtype="fp32")["checkpoints"][0]
    bf16 = replayed(small_store, tmp_path, trained_drafter, "b")["checkpoints"][0]
    assert abs(bf16["tau"] - fp32["tau"]) <= 0.02 * fp32["tau"]
    for b in ("4", "16"):
        assert abs(bf16["ddtree"][b] - fp32["ddtree"][b]) <= 0.02 * fp32["ddtree"][b]


def test_a_seeded_sample_with_its_interval(small_store, trained_drafter, tmp_path):
    everything = replayed(small_store, tmp_path, trained_drafter, "all")
    a = replayed(small_store, tmp_path, trained_drafter, "a", max_prompts=6)
    again = replayed(small_store, tmp_path, trained_drafter, "b", max_prompts=6)
    other = replayed(small_store, tmp_path, trained_drafter, "c", max_prompts=6, seed=1)
    n = everything["sample"]["available"]
    assert a["sample"] == {
        "prompts": 6,
        "available": n,
        "seed": 0,
        "live_prompts": None,
        "processes": 1,
        "devices": ["cpu"],
        "dtype": "bf16",
    }
    picked = [[(p["shard"], p["index"]) for p in r["checkpoints"][0]["per_prompt"]] for r in (a, again, other)]
    assert picked[0] == picked[1] != picked[2] and len(set(picked[0])) == 6
    r = a["checkpoints"][0]
    lo, hi = r["tau_ci95"]
    assert lo < r["tau"] < hi and set(r["ddtree_ci95"]) == {"4", "16"}
    assert f"6 of {n} prompts (random sample, seed 0)" in (tmp_path / "a" / "report.md").read_text()


def test_tau_interval_is_over_prompts_when_every_prompt_was_replayed(small_store, trained_drafter, tmp_path):
    """Every available prompt replayed: the interval is still over the per-prompt taus, chain and every
    DDTree budget (not a point), the per-context table's figure for the same prompts, and the console
    and report.md print it."""
    from pipeline.decode.acceptance import ci95
    from stages.evaluate.report import console

    rep = replayed(small_store, tmp_path, trained_drafter)
    r = rep["checkpoints"][0]
    assert rep["sample"]["prompts"] == rep["sample"]["available"] == r["prompts"]
    lo, hi = r["tau_ci95"]
    assert lo < r["tau"] < hi and lo == pytest.approx(ci95([p["tau"] for p in r["per_prompt"]], r["tau"])[0])
    for b in ("4", "16"):
        assert r["ddtree_ci95"][b] == pytest.approx(ci95([p["ddtree"][b] for p in r["per_prompt"]], r["ddtree"][b]))
        assert r["ddtree_ci95"][b][0] < r["ddtree_ci95"][b][1]
    whole = r["per_context"]["<1k"]  # the small store's rounds are all under 1k tokens: the same prompts
    assert whole["prompts"] == r["prompts"] and whole["tau_ci95"] == pytest.approx(r["tau_ci95"])
    assert all(whole["ddtree_ci95"][b] == pytest.approx(r["ddtree_ci95"][b]) for b in ("4", "16"))
    shown = f"{lo:.3f}-{hi:.3f}"
    assert shown in console(rep) and shown in (tmp_path / "rep" / "report.md").read_text()


def test_two_processes_give_the_report_of_one(small_store, trained_drafter, tmp_path):
    one = replayed(small_store, tmp_path, trained_drafter, "one", dtype="fp32")
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            "29573",
            "evaluate.py",
            "--store",
            str(small_store),
            "--checkpoint",
            str(trained_drafter),
            "--shards",
            "0-3",
            "--ddtree",
            "4,16",
            "--max-prompts",
            "all",
            "--dtype",
            "fp32",
            "--out",
            str(tmp_path / "two"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("tau pooled") == 1  # rank 0 alone prints the table
    two = json.loads((tmp_path / "two" / "report.json").read_text())
    assert two["sample"]["processes"] == 2
    a, b = one["checkpoints"][0], two["checkpoints"][0]
    for key in ("per_prompt", "tau", "tau_pooled", "histogram", "ddtree", "rounds", "prompts"):
        assert a[key] == b[key], key


def test_bf16_drafter_uses_the_stored_embedding_and_head_without_copies(small_store, trained_drafter):
    from stages.evaluate.conditioning import build, check_checkpoint

    store = HiddenStore(str(small_store))
    embed, head = store.embedding("embed_tokens"), store.embedding("lm_head")
    ck = check_checkpoint(str(trained_drafter), store, False, [])
    m = build(ck, embed, head, "cpu", "bf16")
    assert m.lm_head.data_ptr() == head.data_ptr() and m.embed_tokens.data_ptr() == embed.data_ptr()
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16} and m.rotary.inv_freq.dtype == torch.float32
    m32 = build(ck, embed, head, "cpu", "fp32")
    assert m32.lm_head.dtype == torch.float32 and torch.equal(m32.lm_head, head.float())


def test_a_corrupt_chunk_is_never_replayed(store_copy, tmp_path):
    from store.errors import StoreCorrupt
    from tests.conftest import damage_states

    ck = our_checkpoint(store_copy, tmp_path / "ck")
    damage_states(store_copy, 3)
    with pytest.raises(
        StoreCorrupt,
        match=r"shards/00003/hidden.* fails its crc32c checksum .*\(shard 3, sample \d+\); "
        r"run `pipeline verify .* --shards 3`",
    ):
        evaluate(store_copy, tmp_path, ck, shards="3")
    assert not (tmp_path / "rep" / "report.json").exists()


def fake_vllm_python(tmp_path) -> str:
    """An executable standing in for vLLM's Python (tests/fake_vllm_python.py)."""
    path = tmp_path / "fake-vllm-python"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{REPO}/tests/fake_vllm_python.py" "$@"\n')
    path.chmod(0o755)
    return str(path)


def test_rank_0s_extra_work_holds_no_other_process_in_a_collective(small_store, trained_drafter, tmp_path):
    """--live and --served on rank 0 alone, under a launch whose collectives give up after 6 s; the
    engine takes 15 s (as vLLM loading a 27B target takes minutes), so a process waiting for rank 0
    in a collective aborts the launch, as it did before every collective came first."""
    from pipeline import TINY_TARGET

    env = {**os.environ, "OMP_NUM_THREADS": "1", "FAKE_VLLM_SECONDS": "15"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "tests.short_timeout",
            "6",
            "--store",
            str(small_store),
            "--checkpoint",
            str(trained_drafter),
            "--shards",
            "0-3",
            "--ddtree",
            "none",
            "--max-prompts",
            "all",
            "--live",
            "--live-prompts",
            "4",
            "--target",
            str(TINY_TARGET),
            "--served",
            "vllm",
            "--served-python",
            fake_vllm_python(tmp_path),
            "--out",
            str(tmp_path / "rep"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["sample"]["processes"] == 2 and rep["sample"]["devices"] == ["cpu", "cpu"]
    c = rep["checkpoints"][0]
    assert c["live"]["prompts_equal_to_replay"] == 4 and c["served"]["prompts"] == rep["sample"]["prompts"]
    assert c["served"]["device"] == "cpu" and c["served"]["vllm_metrics"]["gpu_memory_utilization"] is None
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "2 processes on cpu" in md and "Served by vllm fake on cpu" in md


def test_one_checkpoint_at_a_time_is_in_memory(small_store, trained_drafter, tmp_path, monkeypatch):
    """Three checkpoints: each is checked up front without reading its weights, and each drafter
    built (replay, then --live) is gone before the next is built."""
    import gc
    import weakref

    from pipeline import TINY_TARGET
    from pipeline.drafter import checkpoint as ck
    from stages.evaluate import run as evaluation

    built, loads, real_build, real_load = [], [], evaluation.build, ck.load

    def build(*a, **k):
        gc.collect()
        assert all(r() is None for r in built), "an earlier drafter is still alive"
        m = real_build(*a, **k)
        built.append(weakref.ref(m))
        return m

    monkeypatch.setattr(evaluation, "build", build)
    monkeypatch.setattr(ck, "load", lambda path: loads.append(path) or real_load(path))
    rep = evaluate(
        small_store,
        tmp_path,
        trained_drafter,
        trained_drafter,
        trained_drafter,
        shards="0-3",
        live=True,
        live_prompts=2,
        target=str(TINY_TARGET),
    )
    assert len(built) == 6 and len(loads) == 6  # replay then live, each reading its weights then
    assert [c["live"]["prompts_equal_to_replay"] for c in rep["checkpoints"]] == [2, 2, 2]
