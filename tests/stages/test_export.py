"""pipeline export: exactly the serving files, the tensors bit for bit, the card, the refusals."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.drafter import checkpoint
from pipeline.drafter.config import TrainingRecord
from pipeline.errors import DrafterError
from stages.evaluate.config import EvalConfig
from stages.evaluate.run import run as evaluate
from stages.export import card
from stages.export.config import ExportConfig
from stages.export.run import run as export
from store.errors import ConfigError
from store.hidden_store import HiddenStore
from tests.modes import file_modes, umask
from tests.test_cli import run_main

FILES = {"config.json", "model.safetensors", "modeling_dflash.py", "README.md"}


def drafter_checkpoint(store_path, directory, train: dict | None = None, **record) -> Path:
    """A random 2-layer drafter for the store, saved with a TrainingRecord that names the store."""
    from pipeline.drafter.model import Drafter
    from stages.train.config import TrainConfig
    from stages.train.setup import drafter_config

    store = HiddenStore(str(store_path))
    dc, _ = drafter_config(TrainConfig.of(num_layers=2, **(train or {})), store.attrs, None)
    m = Drafter(dc, store.embedding("embed_tokens"), store.embedding("lm_head"))
    m.init_weights(torch.Generator().manual_seed(0))
    info = {
        "store_fingerprint": store.attrs.fingerprint,
        "store": str(store_path),
        "train_shards": "0-2",
        "eval_shards": "3",
        "step": 7,
        "train_config": {
            "lr": 0.0031,
            "batch_size": 2,
            "anchors": 16,
            "gamma": 7.0,
            "optimizer": "muon",
            "acceptance_weight": 0.5,
        },
    }
    checkpoint.save(directory, dc, m.state_dict(), TrainingRecord(**{**info, **record}))
    return directory


@pytest.fixture(scope="module")
def measured(small_store, tmp_path_factory):
    """(checkpoint, its replay report directory): evaluate.py run on a few held-out prompts."""
    root = tmp_path_factory.mktemp("export")
    ck = drafter_checkpoint(small_store, root / "run" / "step-7")
    rep = evaluate(
        EvalConfig(
            store=str(small_store),
            checkpoints=(str(ck),),
            out=str(root / "report"),
            ddtree=(4, 8),
            max_prompts=3,
            device="cpu",
        ),
        log=lambda m: None,
    )
    assert rep["checkpoints"][0]["tau"] >= 1
    return ck, root / "report"


def run(ck, out, log=None, **flags):
    lines = []
    result = export(str(ck), str(out), ExportConfig(**flags), log=lines.append if log is None else log)
    return result, lines


def test_exactly_the_serving_files_with_the_same_tensors_and_config(measured, tmp_path):
    ck, _ = measured
    result, _ = run(ck, tmp_path / "out")
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} == FILES and set(result["files"]) == FILES
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary sibling left behind
    a, b = load_file(str(ck / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]) for k in a)
    src, dst = json.loads((ck / "config.json").read_text()), json.loads((out / "config.json").read_text())
    assert dst["auto_map"] == checkpoint.AUTO_MAP and dst["dtype"] == "bfloat16"
    assert dst == src
    assert (out / "modeling_dflash.py").read_bytes() == checkpoint.MODELING_SOURCE.read_bytes()
    assert checkpoint.load(out)[2].step == 7  # strict load, the training record kept


def test_card_states_target_taps_training_and_the_reports_tau(measured, small_store, tmp_path):
    ck, report = measured
    run(ck, tmp_path / "out", report=str(report))
    text = (tmp_path / "out" / "README.md").read_text()
    attrs = HiddenStore(str(small_store)).attrs
    entry = json.loads((report / "report.json").read_text())["checkpoints"][0]
    assert text.startswith("---\nlibrary_name: transformers\n") and "- speculative-decoding" in text
    assert 'base_model: "tiny_target"' in text and f"`{attrs.target.path}`" in text
    assert f"| taps (`target_layer_ids`) | {', '.join(map(str, attrs.taps))}: the outputs of layer k, " in text
    assert "`hidden_states[k+1]`" in text and f"| decoder layers | {attrs.num_layers} |" in text
    assert f"| store fingerprint | `{attrs.fingerprint}` |" in text and "| steps | 7 |" in text
    assert "| learning rate | 0.0031 |" in text and "| anchors per sequence | 16 |" in text
    assert "| optimizer | muon |" in text and "| expected-acceptance weight | 0.5 |" in text
    assert f"| chain | {entry['tau']:.3f} |" in text
    assert f"| DDTree-8 | {entry['ddtree']['8']:.3f} |" in text and f"| DDTree-4 | {entry['ddtree']['4']:.3f} |" in text
    assert "Not measured" not in text and "drafter in bf16" in text
    spec = json.dumps({"method": "dflash", "model": str(tmp_path / "out"), "num_speculative_tokens": 15})
    assert f"vllm serve {attrs.target.path} --speculative-config '{spec}'" in text
    assert "--speculative-num-draft-tokens 16" in text and "trust_remote_code=True" in text
    assert "draft.spec_generate(target=target, input_ids=input_ids" in text


def test_without_a_report_the_card_says_how_to_measure(measured, small_store, tmp_path):
    ck, _ = measured
    result, _ = run(ck, tmp_path / "out")
    text = (tmp_path / "out" / "README.md").read_text()
    assert result["tau"] is None
    assert f"Not measured: run\n\n    python evaluate.py --store {small_store} --checkpoint {ck}" in text


TRAINED = {"lr": 0.0031, "batch_size": 2, "epochs": 6, "max_steps": 2000}


def test_card_states_the_epochs_the_run_made_not_the_configured_ones(small_store, tmp_path):
    """--max-steps stopped the run after 11.1 epochs of the 6 --epochs asked for: the card says 11.1."""
    ck = drafter_checkpoint(small_store, tmp_path / "ck", step=2000, epochs=11.1, train_config=TRAINED)
    run(ck, tmp_path / "out")
    text = (tmp_path / "out" / "README.md").read_text()
    assert "| epochs | 11.1 |" in text and "| epochs | 6 |" not in text and "| max steps | 2000 |" in text


def test_an_older_record_without_epochs_still_loads_and_exports(small_store, tmp_path):
    """A checkpoint written before the record had `epochs`: loaded strictly, exported, the card says so."""
    from pipeline.drafter.config import OUR_KEY

    ck = drafter_checkpoint(small_store, tmp_path / "ck", step=2000, train_config=TRAINED)
    cfg = json.loads((ck / "config.json").read_text())
    cfg[OUR_KEY].pop("epochs", None)  # as an older writer left it
    (ck / "config.json").write_text(json.dumps(cfg))
    assert checkpoint.load(ck)[2].epochs is None
    run(ck, tmp_path / "out")
    text = (tmp_path / "out" / "README.md").read_text()
    assert "| epochs | not recorded (run with --epochs 6, --max-steps 2000) |" in text


def test_a_served_report_puts_served_tau_beside_replay_tau(measured, tmp_path):
    ck, report = measured
    rep = json.loads((report / "report.json").read_text())
    side = {"prompts": 5, "served_tau": 2.5, "replay_tau": 2.4, "difference": 2.5 / 2.4 - 1}
    rep["checkpoints"][0]["served"] = {
        "engine": "vllm 0.32.0",
        "prompts": 6,
        "identical_completions": 5,
        "agreeing": side,
        "all": {**side, "prompts": 6},
    }
    (tmp_path / "served.json").write_text(json.dumps(rep))
    run(ck, tmp_path / "out", report=str(tmp_path / "served.json"))
    text = (tmp_path / "out" / "README.md").read_text()
    assert "Chain drafting served by vllm 0.32.0 over the same prompts" in text
    assert "| served completion = stored | 5 of 6 | 2.500 | 2.400 |" in text and "| all | 6 | 2.500 | 2.400 |" in text


def test_report_is_matched_by_name_and_refused_without_an_entry(measured, tmp_path):
    ck, report = measured
    rep = json.loads((report / "report.json").read_text())
    rep["checkpoints"][0]["path"] = "/elsewhere/run/step-7"  # evaluated from another directory: the name matches
    (tmp_path / "moved.json").write_text(json.dumps(rep))
    assert run(ck, tmp_path / "a", report=str(tmp_path / "moved.json"))[0]["tau"] == rep["checkpoints"][0]["tau"]
    rep["checkpoints"][0]["name"] = "other/final"
    (tmp_path / "other.json").write_text(json.dumps(rep))
    with pytest.raises(ConfigError, match=r"has no entry for checkpoint .*step-7; its checkpoints: other/final"):
        run(ck, tmp_path / "b", report=str(tmp_path / "other.json"))
    rep["checkpoints"][0].update(name="run/step-7", step=3)  # the same path, an earlier drafter
    (tmp_path / "stale.json").write_text(json.dumps(rep))
    with pytest.raises(ConfigError, match="it measured step 3, the checkpoint is step 7"):
        run(ck, tmp_path / "c", report=str(tmp_path / "stale.json"))


def test_report_on_another_store_is_refused_unless_allowed(measured, tmp_path):
    ck, report = measured
    rep = json.loads((report / "report.json").read_text())
    rep["store_fingerprint"] = "f" * 64
    (tmp_path / "report.json").write_text(json.dumps(rep))
    with pytest.raises(
        ConfigError,
        match=r"--report .*not a report on this checkpoint's store: "
        r"it replayed store f{12},",
    ):
        run(ck, tmp_path / "out", report=str(tmp_path))
    assert not (tmp_path / "out").exists()
    _, lines = run(ck, tmp_path / "out", report=str(tmp_path), allow_mismatch=True)
    assert any("MISMATCH allowed" in w for w in lines)
    assert "MISMATCH allowed" in (tmp_path / "out" / "README.md").read_text()


def test_store_of_another_fingerprint_is_refused(small_store, tmp_path):
    ck = drafter_checkpoint(small_store, tmp_path / "ck", store_fingerprint="0" * 64)
    with pytest.raises(DrafterError, match="not the store this checkpoint was trained on.*store fingerprint"):
        run(ck, tmp_path / "out")
    run(ck, tmp_path / "out", allow_mismatch=True)
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_sliding_window_drafter_warns_and_the_card_lists_it(small_store, monkeypatch, capsys, tmp_path):
    ck = drafter_checkpoint(small_store, tmp_path / "ck", {"layer_types": "sliding,full", "sliding_window": 8})
    code, out, err = run_main(monkeypatch, capsys, ["export", str(ck), str(tmp_path / "out")])
    sliding = [w for w in err.splitlines() if w.startswith("warning: sliding_attention layers (window 8)")]
    assert code == 0 and len(sliding) == 1 and "reference DFlash" in sliding[0]
    assert "serving caveat(s): see stderr" in out
    text = (tmp_path / "out" / "README.md").read_text()
    caveats = text[text.index("## Serving caveats") :]
    assert f"- {sliding[0].removeprefix('warning: ')}" in caveats
    assert "VLLM_USE_V2_MODEL_RUNNER=1 vllm serve" in text and "| sliding window | 8 |" in text


def test_full_attention_drafter_has_no_caveat(measured, tmp_path):
    ck, _ = measured
    result, lines = run(ck, tmp_path / "out")
    assert lines == [] and result["warnings"] == []
    assert "None known" in (tmp_path / "out" / "README.md").read_text()


def test_unopenable_store_skips_the_target_checks(measured, tmp_path):
    ck, _ = measured
    result, lines = run(ck, tmp_path / "out", store=str(tmp_path / "gone.zarr"))
    assert result["target"] is None and any("target checks skipped" in w and "gone.zarr" in w for w in lines)
    text = (tmp_path / "out" / "README.md").read_text()
    assert "## Target\n\nNot checked: store" in text and "base_model" not in text
    assert "target checks skipped" in text[text.index("## Serving caveats") :]


def test_only_an_earlier_export_is_replaced_and_only_with_force(measured, tmp_path):
    ck, _ = measured
    out = tmp_path / "out"
    run(ck, out)
    before = (out / "README.md").read_text()
    with pytest.raises(ConfigError) as e:
        run(ck, out)
    assert str(e.value) == (
        f"OUT_DIR {out}: already holds an earlier export (config.json, model.safetensors, "
        "modeling_dflash.py, README.md); pass --force to replace it, or choose another OUT_DIR"
    )
    (out / "README.md").write_text("edited")
    run(ck, out, force=True)
    assert {p.name for p in out.iterdir()} == FILES and (out / "README.md").read_text() == before
    (out / "keep.txt").write_text("mine")  # an export with a file of the user's: not export's alone any more
    for force in (False, True):
        with pytest.raises(ConfigError) as e:
            run(ck, out, force=force)
        assert str(e.value) == (
            f"OUT_DIR {out}: holds files pipeline export did not write (keep.txt): export writes "
            "a serving checkpoint into an empty directory or one holding an earlier export; choose "
            "another OUT_DIR"
        )
    assert (out / "keep.txt").read_text() == "mine"
    with pytest.raises(ConfigError, match="holds the checkpoint"):
        run(ck, ck, force=True)
    with pytest.raises(ConfigError, match="holds the checkpoint"):
        run(ck, ck.parent, force=True)
    with pytest.raises(ConfigError, match="lies inside the checkpoint"):
        run(ck, ck / "serving")
    assert {p.name for p in ck.iterdir()} >= {"config.json", "model.safetensors"}  # the source untouched


def a_run(directory: Path) -> Path:
    """What train.py leaves in OUT (the drafters themselves do not matter here)."""
    for d in ("step-20", "final"):
        (directory / d).mkdir(parents=True)
        (directory / d / "config.json").write_text("{}")
    (directory / "metrics.jsonl").write_text('{"split": "train", "step": 1}\n')
    (directory / "curve.png").write_bytes(b"png")
    return directory


def tree(directory: Path) -> dict:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


WRITES = "export writes a serving checkpoint into an empty directory or one holding an earlier export"


def test_force_never_replaces_a_store_a_run_or_a_checkpoint(measured, store_copy, monkeypatch, capsys, tmp_path):
    """`pipeline export CKPT DIR --force` on a directory export did not write is one line saying what DIR is, and
    DIR is left as it was; --force is not offered where it would not help."""
    ck, _ = measured
    run_dir = a_run(tmp_path / "runs" / "tiny")
    cases = {
        store_copy: "is a hidden-state store (zarr.json, shards/, _commits/, ...)",
        run_dir: "is a training run (metrics.jsonl, final/, curve.png, ...)",
        run_dir / "final": "is a drafter checkpoint (config.json)",
        store_copy / "shards" / "drafter": f"lies inside the hidden-state store {store_copy}",
    }
    before = {d: tree(d) for d in (store_copy, run_dir)}
    for out, what in cases.items():
        for force in ([], ["--force"]):
            code, stdout, err = run_main(monkeypatch, capsys, ["export", str(ck), str(out), *force])
            end = (
                "no command writes its output into a store; choose a directory outside it"
                if "store" in what
                else f"{WRITES}; choose another OUT_DIR"
            )
            assert (code, stdout, err) == (2, "", f"error: OUT_DIR {out}: {what}: {end}\n")
    assert {d: tree(d) for d in (store_copy, run_dir)} == before


def test_the_current_directory_is_one_line_not_a_traceback(measured, monkeypatch, capsys, tmp_path):
    ck, _ = measured
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    code, out, err = run_main(monkeypatch, capsys, ["export", str(ck), ".", "--force"])
    assert (code, out) == (2, "") and err == (
        "error: OUT_DIR .: is the current directory, which export cannot replace "
        "(it publishes OUT_DIR by a rename); run it from another directory\n"
    )
    (here / "notes.txt").write_text("mine")
    code, out, err = run_main(monkeypatch, capsys, ["export", str(ck), ".", "--force"])
    assert code == 2 and err.startswith("error: OUT_DIR .: holds files pipeline export did not write (notes.txt)")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(monkeypatch, capsys, ["export", str(ck), "here/../fresh"])
    assert code == 0 and {p.name for p in (tmp_path / "fresh").iterdir()} == FILES, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "here"]  # no lock, no temporary left


def test_a_second_export_to_one_out_dir_is_refused_naming_the_first(measured, tmp_path):
    import os

    from store.io.locks import HOST, LockFile

    ck, _ = measured
    first = LockFile(tmp_path / ".out.export.lock")  # where a running export holds OUT_DIR tmp_path/out
    assert first.try_acquire() is None
    with pytest.raises(ConfigError) as e:
        run(ck, tmp_path / "out")
    assert str(e.value).startswith(
        f"OUT_DIR {tmp_path / 'out'}: another pipeline export is writing it (host {HOST}, pid {os.getpid()}, since "
    )
    assert str(e.value).endswith("); wait for it, or choose another OUT_DIR") and not (tmp_path / "out").exists()
    first.release()


def test_a_directory_another_command_made_meanwhile_is_refused_not_replaced(measured, tmp_path, monkeypatch):
    """A trainer that made OUT_DIR while export wrote its files beside it: export refuses to publish over it."""
    ck, _ = measured
    out = tmp_path / "out"
    real = checkpoint.write

    def write_while_a_trainer_starts(directory, *args, **kw):
        real(directory, *args, **kw)
        out.mkdir()
        (out / ".train.lock").write_text("{}")

    monkeypatch.setattr(checkpoint, "write", write_while_a_trainer_starts)
    with pytest.raises(ConfigError, match=r"is a training run \(\.train\.lock\): export writes"):
        run(ck, out, force=True)
    assert [p.name for p in out.iterdir()] == [".train.lock"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_the_serving_files_are_as_readable_as_the_umask_makes_files(measured, tmp_path):
    """A serving engine under another account reads them: model.safetensors is not owner-only."""
    ck, _ = measured
    with umask(0o022):
        run(ck, tmp_path / "out")
    assert file_modes(tmp_path / "out") == {f: "0644" for f in FILES}


def test_a_failed_export_leaves_no_directory_it_created(measured, tmp_path, monkeypatch):
    """OUT_DIR's parents made for the hidden sibling go again when the write fails (a full disk);
    a directory that was there before stays."""
    ck, _ = measured

    def full(*args, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "write", full)
    (tmp_path / "there").mkdir()
    for out in (tmp_path / "new" / "deeper" / "drafter", tmp_path / "there" / "drafter"):
        with pytest.raises(OSError, match="No space left"):
            run(ck, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["there"] and not any((tmp_path / "there").iterdir())


def test_card_names_a_hub_target_by_its_id():
    from store.format.schema import TargetRecord

    t = TargetRecord(
        path="/h/.cache/huggingface/hub/models--Qwen--Qwen3.6-27B/snapshots/abc123",
        model_class="x",
        model_type="qwen3_5",
        fingerprint="f",
        config_sha256="c",
        weights_sha256={},
        tokenizer_sha256="t",
        chat_template_sha256="c",
    )
    assert card.base_model(t) == card.served_as(t) == "Qwen/Qwen3.6-27B"
    assert card.base_model(None) is None and card.served_as(None) == "TARGET"


def test_cli_one_line_error_for_a_missing_checkpoint(monkeypatch, capsys, tmp_path):
    code, out, err = run_main(monkeypatch, capsys, ["export", str(tmp_path / "nope"), str(tmp_path / "out")])
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.splitlines() == [
        f"error: {tmp_path / 'nope' / 'config.json'}: no such file (not a drafter checkpoint directory)"
    ]


def test_cli_prints_the_summary(measured, monkeypatch, capsys, tmp_path):
    ck, report = measured
    code, out, err = run_main(monkeypatch, capsys, ["export", str(ck), str(tmp_path / "out"), "--report", str(report)])
    assert code == 0 and err == ""
    assert out.startswith(f"exported {ck} -> {tmp_path / 'out'}: config.json (") and "model.safetensors (" in out
    assert "step: 7; replay tau: " in out


def test_a_dspark_drafter_exports_as_vllms_dspark_model(small_store, tmp_path):
    ck = drafter_checkpoint(small_store, tmp_path / "ck", train={"head": "dspark", "markov_rank": 8})
    result, lines = run(ck, tmp_path / "out")
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3DSparkModel"] and hf["markov_rank"] == 8
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.bias"} <= set(tensors)
    text = (tmp_path / "out" / "README.md").read_text()
    assert '"method": "dspark"' in text and "VLLM_USE_V2_MODEL_RUNNER=1 vllm serve" in text
    assert any("dspark head: only vLLM" in w for w in result["warnings"])
