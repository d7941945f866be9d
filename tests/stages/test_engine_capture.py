"""--capture vllm (stages/extract/engine_capture.py): the tap states captured inside vLLM equal the
ones transformers captures here, tap for tap, within bf16 rounding.

The engine tests are opt-in (`pytest -m engine`: the engine's venv, built once by
tools/engines/build_vllm_cpu.sh, and one engine start of a few minutes on CPU). They capture every
layer of the shipped tiny target (taps 0-7, vLLM ids 1-8) over a few token sequences with both and
hold, per tap: median cosine >= COS_MEDIAN, minimum cosine >= COS_MIN, max abs <= MAX_ABS, a share
of bit-identical bf16 values >= SAME. The same thresholds fail the states one layer off either way
(tap k against k-1 and k+1: the off-by-one of SPEC section 3) and the last layer's output after the
final norm (a capture taken at the wrong end of the norm), so the tap convention is what passes.
Every position has its state (none all zeros, the first of each sequence included) and the engine's
greedy agreement is the target's. The checks that need no engine run in the default suite.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from pipeline import DEFAULT_PROMPTS, TINY_TARGET
from pipeline.errors import EngineError
from stages.extract.config import ExtractConfig
from stages.extract.engine_capture import VllmCapture, check_python, vllm_layer_ids
from store.errors import ConfigError

TAPS = list(range(8))  # every layer of the tiny target
TAU_TOLERANCE = 0.02  # |tau on the other store / tau on its own - 1|: as the served test's (test_engine_served.py)
COS_MEDIAN, COS_MIN, MAX_ABS, SAME = 0.9999, 0.999, 0.125, 0.15  # measured: 0.99996-0.99998, 0.99989, 0.0625, 21-30%


def stats(a: torch.Tensor, b: torch.Tensor) -> dict:
    """a, b: [T, H] bf16 states of one tap: per-token cosine (median, min), max abs, bit-identical share."""
    cos = torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)
    return {
        "cos_median": cos.median().item(),
        "cos_min": cos.min().item(),
        "max_abs": (a.float() - b.float()).abs().max().item(),
        "same": (a.view(torch.int16) == b.view(torch.int16)).float().mean().item(),
    }


def equal(s: dict) -> bool:
    """Within bf16 rounding of each other, by every measure."""
    return s["cos_median"] >= COS_MEDIAN and s["cos_min"] >= COS_MIN and s["max_abs"] <= MAX_ABS and s["same"] >= SAME


def kept_log(error: Exception) -> Path:
    """The engine log an error names (kept for the user), removed once seen to exist."""
    log = Path(re.search(r"\(log (/\S+)\)$", str(error)).group(1))
    assert log.is_file()
    log.unlink()
    return log


def test_tap_k_is_vllm_layer_id_k_plus_1():
    assert vllm_layer_ids([0, 1, 16, 31]) == [1, 2, 17, 32]


def test_a_python_without_vllm_is_refused_in_one_line():
    with pytest.raises(EngineError, match=r"--capture-python .*cannot import vllm"):
        check_python(sys.executable)  # this venv has no vLLM
    with pytest.raises(EngineError, match=r"--capture-python /nonexistent/python: cannot run it"):
        check_python("/nonexistent/python")


def fake_vllm(tmp_path, version: str) -> str:
    """A Python whose `vllm` is a stub of that version (no engine in it), a directory per version: two
    stubs of one size written in the same second would share a stale bytecode cache."""
    where = tmp_path / f"vllm-{version}"
    (where / "vllm").mkdir(parents=True, exist_ok=True)
    (where / "vllm" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    python = where / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={where} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return str(python)


def test_a_too_old_vllm_is_refused(tmp_path):
    with pytest.raises(EngineError, match=r"vLLM 0.11.2 is older than 0.32"):
        check_python(fake_vllm(tmp_path, "0.11.2"))
    assert check_python(fake_vllm(tmp_path, "0.32.0")) == "0.32.0"


def test_an_engine_that_fails_to_start_is_one_line_and_leaves_no_files(tmp_path):
    import glob
    import tempfile

    pattern = f"{tempfile.gettempdir()}/dflash-capture-*/"
    before = set(glob.glob(pattern))
    engine = VllmCapture(fake_vllm(tmp_path, "0.32.0"), str(TINY_TARGET), [1, 2], 128, "bf16", 256, None)
    with pytest.raises(
        EngineError, match=r"^--capture vllm: the engine stopped \(exit 1\): \w*Error: (cannot import|No module named)"
    ) as failed:
        try:
            engine.start()  # the stub is a version alone: nothing of vLLM imports from it
        finally:
            engine.close()
    assert set(glob.glob(pattern)) == before
    kept_log(failed.value)


def test_a_tap_out_of_range_is_refused_before_the_engine_starts_or_a_shard_is_claimed(tmp_path):
    from stages.extract.run import run as extract

    config = ExtractConfig(
        store=str(tmp_path / "hs.zarr"),
        capture="vllm",
        capture_python=fake_vllm(tmp_path, "0.32.0"),
        taps="1,8",
        dtype="bf16",
        device="cpu",
    )
    with pytest.raises(ConfigError, match=r"--taps.*layer id\(s\) \[8\] out of range.*8 decoder layers"):
        extract(config, log=lambda m: None)
    assert not (tmp_path / "hs.zarr").exists()


def test_capture_flags_go_with_capture_vllm():
    with pytest.raises(ConfigError, match="--capture-python"):
        ExtractConfig(capture_python="/usr/bin/python3", device="cpu")
    with pytest.raises(ConfigError, match="--capture-memory"):
        ExtractConfig(capture="vllm", capture_memory=1.5, device="cpu")
    assert ExtractConfig(capture="vllm", device="cpu").capture_python == sys.executable


@pytest.fixture(scope="module")
def captured(target_bf16):
    """Both captures of the same sequences: (vLLM's, transformers', sequences, prompt lengths, agreements)."""
    from tests.engines import build_venv

    tok = target_bf16.tokenizer
    texts = [json.loads(line)["messages"][0]["content"] for line in DEFAULT_PROMPTS.read_text().splitlines()[:3]]
    seqs = [tok(t, add_special_tokens=False).input_ids for t in texts]
    seqs = [(s * 200)[:n] for s, n in zip(seqs, (23, 57, 130))]  # 23: the probe's length; others across blocks
    assert list(map(len, seqs)) == [23, 57, 130]
    lens = [10, 30, 64]
    engine = VllmCapture(str(build_venv()), str(TINY_TARGET), TAPS, 128, "bf16", 256, 0.1).start()
    try:
        vllm, vllm_agreement = engine.capture(seqs, TAPS, lens)
        leftovers = sorted(p.name for p in (engine.dir / "states").iterdir())
    finally:
        engine.close()
    assert not engine.dir.exists()
    hf, hf_agreement = target_bf16.capture(seqs, TAPS, lens)
    return {
        "vllm": vllm,
        "hf": hf,
        "seqs": seqs,
        "lens": lens,
        "agreement": (vllm_agreement, hf_agreement),
        "left": leftovers,
    }


@pytest.fixture(scope="module")
def target_bf16():
    from pipeline.target import loading

    return loading.load(str(TINY_TARGET), "cpu", "bf16", "auto")


@pytest.mark.engine
def test_engine_states_equal_transformers_tap_for_tap(captured):
    vllm, hf = captured["vllm"], captured["hf"]
    assert vllm.shape == hf.shape == (sum(map(len, captured["seqs"])), len(TAPS), 128)
    assert vllm.dtype == torch.bfloat16
    for j, k in enumerate(TAPS):
        s = stats(vllm[:, j], hf[:, j])
        print(f"\ntap {k} (vLLM id {k + 1}): " + ", ".join(f"{n} {v:.5f}" for n, v in s.items()))
        assert equal(s), (k, s)
    assert captured["left"] == []  # every file read and deleted


@pytest.mark.engine
def test_one_layer_off_or_after_the_final_norm_fails_the_same_thresholds(captured, target_bf16):
    vllm, hf = captured["vllm"], captured["hf"]
    for j in range(len(TAPS)):
        for off in (j - 1, j + 1):
            if 0 <= off < len(TAPS):
                s = stats(vllm[:, j], hf[:, off])
                assert not equal(s), (j, off, s)
    normed = target_bf16.model.get_decoder().norm(hf[:, -1])
    s = stats(vllm[:, -1], normed)
    print(f"\nlast tap against the final norm's output: {s}")
    assert not equal(s), s


@pytest.mark.engine
def test_every_position_has_its_state(captured):
    vllm, hf, start = captured["vllm"], captured["hf"], 0
    assert not (vllm == 0).all(dim=-1).any()
    for seq in captured["seqs"]:  # the first position of each sequence: what the probe lost
        a, b = vllm[start].float(), hf[start].float()  # [n_taps, H]
        assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() >= COS_MIN
        assert (a - b).abs().max() <= MAX_ABS
        start += len(seq)


@pytest.mark.engine
def test_the_engine_agrees_with_the_target_on_its_greedy_tokens(captured):
    (vm, vt), (hm, ht) = captured["agreement"]
    print(f"\nagreement: vLLM {vm}/{vt}, transformers {hm}/{ht}")
    assert vt == ht == sum(map(len, captured["seqs"])) - sum(captured["lens"])
    assert abs(vm - hm) <= 2  # near-ties of a random target may fall either way in bf16


STORE_SETTINGS = dict(  # two shards of the shipped prompts with their own answers: the same sequences either way
    target=str(TINY_TARGET),
    shards="0-1",
    num_shards=64,
    dtype="bf16",
    device="cpu",
    responses="dataset",
    max_new_tokens=64,
    max_length=256,
    batch_size=4,
    chunk_tokens=32,
    shard_tokens=64,
)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Shards 0-1 of 64 of the shipped prompts (their own answers: the same tokens either way), captured
    by transformers and by vLLM; and the temporary directories an engine capture leaves (none)."""
    import glob
    import tempfile

    from stages.extract.run import run as extract
    from tests.engines import build_venv

    root = tmp_path_factory.mktemp("capture")
    settings = STORE_SETTINGS
    engine = dict(capture="vllm", capture_python=str(build_venv()), capture_memory=0.1)
    pattern = f"{tempfile.gettempdir()}/dflash-capture-*/"  # the engine's directories, not a kept log
    before = set(glob.glob(pattern))
    out = {"root": root}
    for name, extra in (("hf", {}), ("vllm", engine)):
        out[name] = root / f"{name}.zarr"
        out[f"{name}_summary"] = extract(ExtractConfig(store=str(out[name]), **settings, **extra), log=print)
    out["left"] = set(glob.glob(pattern)) - before
    return out


@pytest.mark.engine
def test_an_engine_captured_store_verifies_and_equals_the_transformers_one(stores):
    from bench.parity import per_tap
    from store.hidden_store import HiddenStore
    from store.summary import render, summarize
    from store.verify import verify

    hf, vllm = HiddenStore(str(stores["hf"])), HiddenStore(str(stores["vllm"]))
    assert verify(vllm, [0, 1]).ok
    figures = per_tap(hf, vllm)  # refuses stores whose token sequences differ
    print(f"\n{figures['tokens']} tokens, stores {hf.location} / {vllm.location}")
    for row in figures["taps"]:
        print(row)
        assert row["cos_min"] >= COS_MIN and row["max_abs"] <= MAX_ABS and row["bit_identical"] >= SAME, row
    assert figures["tokens"] == stores["vllm_summary"]["tokens"] > 0
    capture = vllm.attrs.compat.capture
    assert capture["engine"] == "vllm" and capture["version"].startswith("0.") and capture["tensor_parallel"] == 1
    assert capture["layer_ids"] == [k + 1 for k in vllm.attrs.taps]
    assert hf.attrs.compat.capture is None
    assert all(r.run["capture"] == capture for r in vllm.committed().values())
    assert f"capture      vllm {capture['version']}, bfloat16, tensor parallel 1" in render(summarize(vllm))
    assert hf.attrs.compat.conditioning() != vllm.attrs.compat.conditioning()
    assert hf.attrs.compat.placement() == vllm.attrs.compat.placement()
    print(f"agreement: transformers {stores['hf_summary']['agreement']}, vLLM {stores['vllm_summary']['agreement']}")
    assert stores["left"] == set()  # the engine's directory (config, log, states) removed
    timing, engine = stores["vllm_summary"]["timing"], stores["vllm_summary"]["capture_engine"]
    assert engine["start_s"] > 0 and 0 < engine["engine_s"] + engine["transport_s"] <= timing["capture_s"]
    assert "capture_engine" not in stores["hf_summary"]


@pytest.mark.engine
def test_a_drafter_trained_on_engine_states_is_refused_on_transformers_states_and_replays_alike(stores):
    """Refused without --allow-mismatch; with it, the same replay tau within TAU_TOLERANCE."""
    from pipeline.errors import DrafterError
    from stages.evaluate.config import EvalConfig
    from stages.evaluate.run import run as evaluate
    from stages.train.config import TrainConfig
    from stages.train.run import run as train

    run_dir = stores["root"] / "run"
    train(
        TrainConfig.of(
            store=str(stores["vllm"]), out=str(run_dir), eval_shards="1", max_steps=60, batch_size=4, anchors=32
        ),
        log=lambda m: None,
    )

    def replay(store: str, out: str, allow: bool) -> dict:
        return evaluate(
            EvalConfig(
                store=str(stores[store]),
                checkpoints=(str(run_dir / "final"),),
                shards="1",
                out=str(stores["root"] / out),
                ddtree=(),
                max_prompts=10,
                allow_mismatch=allow,
                device="cpu",
            ),
            log=lambda m: None,
        )

    same = replay("vllm", "same", False)["checkpoints"][0]
    assert same["check"] == "store fingerprint matches"
    with pytest.raises(DrafterError, match="not trained on this store's conditioning"):
        replay("hf", "other", False)
    other = replay("hf", "allowed", True)["checkpoints"][0]
    assert other["check"].startswith("mismatch (allowed)")
    print(f"\nchain tau: on the vLLM store {same['tau']:.4f}, on the transformers store {other['tau']:.4f}")
    assert abs(other["tau"] / same["tau"] - 1) <= TAU_TOLERANCE


def worker_pid() -> int:
    """This process's capture worker (its child running vllm_capture_worker.py)."""
    import os
    from pathlib import Path

    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmd = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if ppid == os.getpid() and b"vllm_capture_worker.py" in cmd:
                return int(proc.name)
    raise AssertionError("no capture worker running")


@pytest.mark.engine
def test_an_engine_killed_mid_run_leaves_nothing_half_committed_and_a_rerun_completes_the_store(stores):
    """The engine (worker and engine processes) SIGKILLed as shard 0 commits: the run stops with one
    line, shard 1 is left uncommitted, the engine's files are gone; the same command then writes
    shard 1, and the store holds what the uninterrupted run stored, bit for bit."""
    import glob
    import os
    import signal
    import tempfile

    from stages.extract.run import run as extract
    from store.hidden_store import HiddenStore
    from store.shard_reader import ShardReader
    from tests.engines import build_venv

    path = stores["root"] / "killed.zarr"
    config = ExtractConfig(
        store=str(path),
        **STORE_SETTINGS,
        capture="vllm",
        capture_python=str(build_venv()),
        capture_memory=0.1,
    )

    def kill_at_first_commit(line: str) -> None:
        if line.startswith("shard 0:"):
            os.killpg(worker_pid(), signal.SIGKILL)

    pattern = f"{tempfile.gettempdir()}/dflash-capture-*/"  # the engine's directories, not a kept log
    before = set(glob.glob(pattern))
    with pytest.raises(
        EngineError, match=r"^--capture vllm: the engine stopped \(killed by signal 9\) \(log /"
    ) as stopped:
        extract(config, log=kill_at_first_commit)
    print(f"\nstopped: {stopped.value}")
    kept_log(stopped.value)
    assert "\n" not in str(stopped.value)
    assert set(glob.glob(pattern)) - before == set()
    assert sorted(HiddenStore(str(path)).committed()) == [0]
    extract(config, log=print)
    done, whole = HiddenStore(str(path)), HiddenStore(str(stores["vllm"]))
    assert sorted(done.committed()) == [0, 1]
    for shard in (0, 1):
        for a, b in zip(ShardReader(done, shard), ShardReader(whole, shard), strict=True):
            assert torch.equal(a.tokens, b.tokens) and torch.equal(
                a.hidden.view(torch.int16), b.hidden.view(torch.int16)
            )


def test_the_summary_gives_the_engines_start_and_the_transports_share():
    from stages.extract.summary import engine_line

    line = engine_line({"start_s": 61.0, "engine_s": 9.0, "transport_s": 0.5}, 10.0)
    assert line == (
        "capture engine: started in 61.0s; of the capture's 10.0s, 9.0s waiting on the engine, "
        "0.50s reading its files (5%)"
    )
    generated = engine_line({"start_s": 61.0, "engine_s": 9.0, "transport_s": 0.5, "generate_s": 14.25}, 10.0)
    assert generated == line + "; 14.2s generating the references"


NEXT_TOKEN_PROBE = """
import json, sys, types, torch
sys.path.insert(0, sys.argv[1])
import vllm_next_token_fix
from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer
from vllm.v1.utils import CpuGpuBuffer

proposer = object.__new__(ExtractHiddenStatesProposer)
proposer.backup_next_token_ids = CpuGpuBuffer(4, dtype=torch.int32, device=torch.device("cpu"), pin_memory=False)
last = {"a": 40, "b": 41, "c": 42}  # each request's last committed token: the backup when a step has none
requests = {r: types.SimpleNamespace(get_token_id=lambda i, r=r: last[r]) for r in last}
batch = types.SimpleNamespace(num_reqs=3, req_ids=["a", "b", "c"], num_tokens_no_spec=[5, 5, 5], vocab_size=100)
sampled = torch.tensor([[5, 7], [3, -1], [-1, -1]])  # two tokens emitted, one, none
keep = torch.zeros(3, dtype=torch.bool)


def step():
    ids, count = ExtractHiddenStatesProposer.prepare_next_token_ids_padded(proposer, sampled, requests, batch, keep)
    return ids.tolist(), count.tolist()


before = step()
applied = [vllm_next_token_fix.apply(), vllm_next_token_fix.apply()]
print(json.dumps({"applied": applied, "before": before, "after": step()}))
"""


@pytest.mark.engine
def test_the_capture_engine_continues_a_two_token_step_from_its_last_token(tmp_path):
    """vLLM #56417: extract_hidden_states continues from the first of two tokens a step emitted. The
    engine's own method shows it (5 for the row [5, 7]); wrapped once by vllm_next_token_fix, the
    engine continues from 7 and counts both, and a row with one token or none is as before."""
    import subprocess

    from stages.extract import engine_capture
    from tests.engines import build_venv

    probe = tmp_path / "probe.py"
    probe.write_text(NEXT_TOKEN_PROBE)
    done = subprocess.run(
        [str(build_venv()), str(probe), str(engine_capture.WORKER.parent)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["applied"] == ["applied", "already"]
    assert out["before"] == [[5, 3, 42], [1, 1, 0]]  # the bug: row 0 continues from 5, one token counted
    assert out["after"] == [[7, 3, 42], [2, 1, 0]]


@pytest.mark.engine
def test_the_capturing_engine_makes_the_references_and_the_target_is_loaded_once(tmp_path):
    """--capture vllm --responses regenerate: the engine that captures generates the references (the
    target here has no weights), the generation's connector files are deleted as they come, the
    references are the engine's own greedy tokens (its prefill agrees on nearly all of them: bf16
    near-ties between decode and prefill), and the store records where they came from."""
    from stages.extract.run import run as extract
    from store.hidden_store import HiddenStore
    from store.verify import verify
    from tests.engines import build_venv

    settings = {**STORE_SETTINGS, "responses": "regenerate", "shards": "0"}
    path = tmp_path / "engine_refs.zarr"
    engine = dict(capture="vllm", capture_python=str(build_venv()), capture_memory=0.1)
    config = ExtractConfig(store=str(path), **settings, **engine)
    summary = extract(config, log=print)
    store = HiddenStore(str(path))
    assert verify(store, [0]).ok
    version = store.attrs.compat.capture["version"]
    assert store.attrs.compat.references == f"vllm {version} (the capturing engine)"
    record = store.committed()[0]
    assert record.run["backends"] is None  # no forward ran in this process: the target had no weights
    matches, tokens = summary["agreement"]["matches"], summary["agreement"]["tokens"]
    print(f"\nreferences by the capturing engine: agreement {matches}/{tokens}, {summary['capture_engine']}")
    assert tokens > 0 and matches >= 0.97 * tokens
    assert summary["capture_engine"]["generate_s"] > 0


@pytest.mark.engine
def test_generation_leaves_no_connector_files(tmp_path):
    """The states vLLM's connector writes for generation requests are deleted by the worker."""
    from pipeline.target import loading
    from tests.engines import build_venv

    target = loading.load(str(TINY_TARGET), torch.device("cpu"), "bf16", "torch", with_weights=False)
    capturer = VllmCapture(str(build_venv()), str(TINY_TARGET), [1, 3], target.hidden_size, "bf16", 257, 0.1)
    try:
        capturer.start()
        completions = capturer.generate([[1, 2, 3], [4, 5, 6, 7], [8]], [16, 0, 4], target.eos_ids)
        left = list((capturer.dir / "states").rglob("*")) if (capturer.dir / "states").exists() else []
    finally:
        capturer.close()
    assert completions[1] == [] and 0 < len(completions[0]) <= 16 and 0 < len(completions[2]) <= 4
    assert [p for p in left if p.is_file()] == []


def test_sampled_references_are_not_made_by_the_capturing_engine():
    """Its sampling runs through the speculative path, where a seeded request is not reproducible."""
    with pytest.raises(ConfigError, match=r"^--temperature 0\.7: not with --capture vllm --responses regenerate"):
        ExtractConfig(capture="vllm", responses="regenerate", temperature=0.7, device="cpu")
    ExtractConfig(capture="vllm", responses="dataset", device="cpu")  # greedy or dataset answers: fine
