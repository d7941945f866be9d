"""--served: vLLM's steps in replay's convention, the comparison, and the worker's failures (no
engine needed; tests/test_engine_served.py runs the real one)."""

import json
import subprocess
import sys
import tempfile

import pytest

from pipeline.errors import EngineError
from stages.evaluate.served import WORKER, call_worker, compare, served_rounds


def test_the_last_step_is_cut_to_what_is_left_as_replay_cuts_it():
    # 1 prefill token + steps of 3+1 and 5+1 tokens, but the completion ended (EOS) 2 tokens into the last step
    tokens = list(range(1 + 4 + 2))
    assert served_rounds(tokens, [3, 5]) == [(3, 4), (2, 2)]
    # vLLM's own convention would count (3+1 + 5+1) / 2 = 5 tokens per step; replay's gives (7 - 1) / 2 = 3
    rounds = served_rounds(tokens, [3, 5])
    assert sum(t for _, t in rounds) == len(tokens) - 1


def test_a_one_token_completion_has_no_round():
    assert served_rounds([7], []) == []


def test_compare_splits_agreeing_prompts_from_the_rest():
    stored = [[1, 2, 3, 4], [5, 6, 7]]
    served = [
        {"token_ids": [1, 2, 3, 4], "accepted": [2], "drafted": [3]},  # agrees: 1 round of 3 tokens
        {"token_ids": [5, 9, 9, 9], "accepted": [0, 1], "drafted": [3, 3]},
    ]  # differs from the store
    replayed = [[(2, 3)], [(0, 1), (0, 1)]]
    out = compare(stored, served, replayed, block_size=4)
    assert out["identical_completions"] == 1 and out["identical_rounds"] == 1
    assert out["agreeing"]["served_tau"] == out["agreeing"]["replay_tau"] == 3.0
    assert out["agreeing"]["difference"] == 0.0
    assert out["all"]["prompts"] == 2
    assert out["all"]["served_tau"] == pytest.approx((3.0 + 1.5) / 2)  # prompt 2: 3 tokens in 2 steps
    assert out["all"]["replay_tau"] == pytest.approx((3.0 + 1.0) / 2)
    assert out["vllm_convention_tau"] == pytest.approx((3.0 + 1.5) / 2)


@pytest.fixture(autouse=True)
def logs_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # a failed worker's log is kept there


def test_a_python_without_vllm_is_one_named_error(tmp_path):
    request = tmp_path / "req.json"
    request.write_text(json.dumps({"prompts": []}))
    code = subprocess.run([sys.executable, str(WORKER), str(request), str(tmp_path / "out.json")]).returncode
    if code == 0:
        pytest.skip("this Python has vLLM")
    assert code == 3 and "cannot import vllm" in json.loads((tmp_path / "out.json").read_text())["error"]
    with pytest.raises(EngineError, match="cannot import vllm"):
        call_worker(sys.executable, {"prompts": [], "drafter": "d"}, lambda m: None)


def test_a_python_without_vllm_is_refused_before_any_replay(tmp_path):
    from stages.evaluate.served import ServedBench

    with pytest.raises(EngineError, match="--served-python /no/python: cannot run it"):
        ServedBench("/no/python", "t", [], None, print)
    if subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True).returncode != 0:
        with pytest.raises(EngineError, match="vLLM is not installed there"):
            ServedBench(sys.executable, "t", [], None, print)


def test_a_worker_that_dies_names_its_log(tmp_path):
    with pytest.raises(EngineError, match=r"exit 1; log .*dflash-served-\d+\.log"):
        call_worker("/bin/false", {"prompts": [], "drafter": "d"}, lambda m: None)


def test_the_engines_root_cause_is_named_not_its_generic_exception():
    from stages.evaluate.served import first_error

    log = [
        "INFO starting",
        "(VllmWorker-0 pid=8032) ERROR [multiproc_executor.py:953]     raise ValueError(",
        "(VllmWorker-0 pid=8032) ERROR [multiproc_executor.py:953] ValueError: Available memory on node 0 "
        "(7.81/11.84 GiB) on startup is less than desired CPU memory utilization (0.92, 10.89 GiB).",
        "Exception: WorkerProc initialization failed due to an exception in a background process.",
        "RuntimeError: Engine core initialization failed. See root cause above.",
    ]
    assert first_error(log) == [log[2].split("] ")[1]]
    assert first_error(log[3:4]) == log[3:4] and first_error(["no trace here"]) == []
