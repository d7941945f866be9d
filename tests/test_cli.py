"""Each bad input gives one clear line naming what is wrong, exit code 2, no traceback."""

import json
import shutil
import sys

import pytest

from pipeline.cli import main
from tests.processes import cli_args, run_pipeline


def run_main(monkeypatch, capsys, args: list[str]) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["pipeline", *args])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def bad_field_dataset(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "hi"}) + "\n")
    return path


@pytest.mark.parametrize(
    "case,expect",
    [
        ("missing_file", "--dataset /nonexistent/prompts.jsonl: no such file"),
        (
            "missing_field",
            "has neither field 'messages' ('conversations') nor 'prompt' nor token ids ('input_ids', 'prompt_ids') "
            "(fields present: ['question'])",
        ),
        ("tap_too_high", "--taps: layer id(s) [8] out of range: the target has 8 decoder layers (ids 0-7)"),
        ("bad_shards", "--shards '0-x': invalid shard range"),
        ("shards_out_of_range", "reaches shard 9, but the store has 4 shards"),
        ("bad_target", "--target /nonexistent/model: not a model directory"),
        ("target_without_config", "no config.json"),
        ("mask_outside_vocab", "--mask-token-id 99999: outside the vocabulary (0-4095)"),
    ],
)
def test_bad_input_one_line(monkeypatch, capsys, tmp_path, small_dataset, bad_field_dataset, case, expect):
    store = tmp_path / "hs.zarr"
    args = {
        "missing_file": cli_args(store, "/nonexistent/prompts.jsonl", "0"),
        "missing_field": cli_args(store, bad_field_dataset, "0"),
        "tap_too_high": cli_args(store, small_dataset, "0") + ["--taps", "1,8"],
        "bad_shards": cli_args(store, small_dataset, "0-x"),
        "shards_out_of_range": cli_args(store, small_dataset, "0-9"),
        "bad_target": cli_args(store, small_dataset, "0") + ["--target", "/nonexistent/model"],
        "target_without_config": cli_args(store, small_dataset, "0") + ["--target", str(tmp_path)],
        "mask_outside_vocab": cli_args(store, small_dataset, "0") + ["--mask-token-id", "99999"],
    }[case]
    code, out, err = run_main(monkeypatch, capsys, args)
    assert code == 2
    assert expect in one_error_line(err)
    assert not (store / "_commits").exists()


def test_store_with_other_fingerprint_is_refused(monkeypatch, capsys, tmp_path, small_store, small_dataset):
    store = tmp_path / "other.zarr"
    shutil.copytree(small_store, store)
    code, out, err = run_main(monkeypatch, capsys, cli_args(store, small_dataset, "0") + ["--dtype", "bf16"])
    assert code == 2
    line = one_error_line(err)
    assert "different target/taps/config" in line and 'dtype: store has "fp32", this run has "bf16"' in line


def test_verify_and_info_commands(monkeypatch, capsys, small_store):
    code, out, err = run_main(monkeypatch, capsys, ["verify", str(small_store), "--shards", "0-3"])
    assert code == 0 and "checked 4 committed shard(s): all good" in out
    code, out, err = run_main(
        monkeypatch, capsys, ["verify", str(small_store), "--shards", "1-2", "--sample", "0.5", "--processes", "2"]
    )
    assert code == 0 and "checked 2 committed shard(s) (states: " in out and "all good" in out
    code, out, err = run_main(monkeypatch, capsys, ["info", str(small_store), "--json"])
    assert code == 0 and json.loads(out)["shards_done"] == 4


def test_verify_uses_every_core_by_default(monkeypatch, capsys, small_store):
    import os

    import store.verify

    asked, real = [], store.verify.verify_store
    monkeypatch.setattr(store.verify, "verify_store", lambda *a: asked.append(a[4]) or real(*a))
    code, out, err = run_main(monkeypatch, capsys, ["verify", str(small_store), "--shards", "0"])
    assert code == 0 and asked == [len(os.sched_getaffinity(0))]


def test_verify_fails_on_missing_shards(monkeypatch, capsys, tmp_path, small_store):
    store = tmp_path / "copy.zarr"
    shutil.copytree(small_store, store)
    (store / "_commits/00002.json").unlink()
    code, out, err = run_main(monkeypatch, capsys, ["verify", str(store), "--shards", "0-3"])
    assert code == 1 and "MISSING shards 2" in err


def test_error_is_one_line_in_a_real_process(tmp_path, small_dataset):
    p = run_pipeline(cli_args(tmp_path / "hs.zarr", small_dataset, "3-1"))
    assert p.returncode == 2
    assert p.stderr.strip() == "error: --shards '3-1': invalid shard range: 3-1 runs backwards"


def test_help_explains_every_flag(monkeypatch, capsys):
    code, out, err = run_main(monkeypatch, capsys, ["extract", "--help"])
    assert code == 0
    for flag in (
        "--store",
        "--shards",
        "--num-shards",
        "--target",
        "--dataset",
        "--max-new-tokens",
        "--max-length",
        "--batch-size",
        "--device",
        "--dtype",
        "--taps",
        "--responses",
    ):
        assert flag in out
