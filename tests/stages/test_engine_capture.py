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
greedy agreement is the target's. Tensor parallel 2 is held to the same thresholds against
transformers and against tensor parallel 1 (on the shipped target's function with heads that split in
two), and an FP8 capture (vLLM's fp8_per_block, the one its CPU build runs) has its quantization
recorded and its distance from bf16 reported, not held to bf16 parity. The checks that need no
engine run in the default suite, with a stub vLLM where an engine's replies are needed (the flags
reaching vLLM, its report recorded, a rerun with another layout refused).
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
FP8_COS_MEAN = 0.999  # fp8_per_block against bf16 transformers, mean cosine per tap; measured 0.99978-0.99982


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


STUB_ENGINE = """
import json, os, types
import torch
from safetensors.torch import save_file

__version__ = "0.32.0"


class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class LLM:
    \"\"\"Echoes its arguments as the layout an engine reports; each prompt's states: its token ids.\"\"\"

    def __init__(self, **kwargs):
        with open(os.environ["STUB_VLLM_KWARGS"], "w") as fh:
            json.dump(kwargs, fh)
        self.kwargs = kwargs
        with open(os.path.join(kwargs["model"], "config.json")) as fh:
            hf = types.SimpleNamespace(**json.load(fh))
        parallel = types.SimpleNamespace(
            tensor_parallel_size=kwargs["tensor_parallel_size"], pipeline_parallel_size=kwargs["pipeline_parallel_size"]
        )
        model = types.SimpleNamespace(hf_config=hf, hf_text_config=hf, quantization=kwargs["quantization"])
        self.llm_engine = types.SimpleNamespace(
            vllm_config=types.SimpleNamespace(parallel_config=parallel, model_config=model),
            model_config=model,
            engine_core=types.SimpleNamespace(shutdown=lambda: None),
        )
        self.taps = len(kwargs["speculative_config"]["draft_model_config"]["hf_config"][
            "eagle_aux_hidden_state_layer_ids"])
        self.hidden, self.dir = hf.hidden_size, kwargs["kv_transfer_config"]["kv_connector_extra_config"][
            "shared_storage_path"]

    def collective_rpc(self, method):
        module, name = self.kwargs["worker_extension_cls"].rsplit(".", 1)
        extension = getattr(__import__(module), name)
        backend = types.SimpleNamespace(get_name=lambda: "STUB_ATTN")
        group = types.SimpleNamespace(backend=backend)
        layer = torch.nn.Linear(2, 2)
        layer.quant_method = types.SimpleNamespace(fp8_linear=None, kernel=None)
        worker = type("Worker", (extension,), {})()
        worker.model_runner = types.SimpleNamespace(attn_groups=[[group]], model=torch.nn.Sequential(layer))
        return [getattr(worker, method)()] * self.kwargs["tensor_parallel_size"]

    def generate(self, prompts, params, use_tqdm=False):
        if os.environ.get("STUB_VLLM_FORWARD_FAILS"):
            raise RuntimeError(os.environ["STUB_VLLM_FORWARD_FAILS"])
        os.makedirs(self.dir, exist_ok=True)
        outs = []
        for i, prompt in enumerate(prompts):
            ids = torch.tensor(prompt.prompt_token_ids)
            states = (ids[:, None, None] + 1).expand(-1, self.taps, self.hidden).to(torch.bfloat16)
            path = os.path.join(self.dir, f"{os.getpid()}-{id(prompt)}-{i}.safetensors")
            save_file({"hidden_states": states.contiguous(), "token_ids": ids}, path)
            open(path + ".lock", "w").close()
            ranks = [None] + [{t: types.SimpleNamespace(rank=1)} for t in prompt.prompt_token_ids[1:]]
            outs.append(types.SimpleNamespace(
                kv_transfer_params={"hidden_states_path": path}, prompt_token_ids=prompt.prompt_token_ids,
                prompt_logprobs=ranks))
        return outs
"""


def stub_engine(tmp_path) -> str:
    """A Python whose `vllm` is a stub engine: it records the arguments its LLM gets (in the file
    $STUB_VLLM_KWARGS), reports them back as its layout, and captures each token's state as its id + 1."""
    where = tmp_path / "vllm-stub-engine"
    (where / "vllm").mkdir(parents=True, exist_ok=True)
    (where / "vllm" / "__init__.py").write_text(STUB_ENGINE)
    (where / "vllm" / "inputs.py").write_text(
        "class TokensPrompt:\n    def __init__(self, prompt_token_ids):\n"
        "        self.prompt_token_ids = prompt_token_ids\n"
    )
    resolving_to(where, "Qwen3_5ForCausalLM", eagle3=True)  # the worker's check before the engine starts
    return shim(where)


def test_the_parallel_sizes_and_quantization_reach_the_engine_and_its_report_is_the_record(tmp_path, monkeypatch):
    kwargs = tmp_path / "kwargs.json"
    monkeypatch.setenv("STUB_VLLM_KWARGS", str(kwargs))
    engine = VllmCapture(
        stub_engine(tmp_path),
        str(TINY_TARGET),
        [1, 2],
        128,
        "bf16",
        256,
        None,
        tensor_parallel=2,
        pipeline_parallel=3,
        quantization="fp8_per_tensor",
    )
    try:
        engine.start()
        states = engine.capture([[5, 6, 7]], [1, 2])  # [3, 2, 128]: each token's id + 1
    finally:
        engine.close()
    given = json.loads(kwargs.read_text())
    assert (given["tensor_parallel_size"], given["pipeline_parallel_size"], given["quantization"]) == (
        2,
        3,
        "fp8_per_tensor",
    )
    assert engine.record == {
        "engine": "vllm",
        "version": "0.32.0",
        "dtype": "bfloat16",
        "tensor_parallel": 2,
        "pipeline_parallel": 3,
        "quantization": "fp8_per_tensor",
        "checkpoint_quantization": None,
        "kernels": {"attention": ["STUB_ATTN"], "linear": ["SimpleNamespace"]},
        "layer_ids": [2, 3],
    }
    assert states[:, 0, 0].tolist() == [6.0, 7.0, 8.0]


def test_a_checkpoints_own_quantization_is_recorded_as_the_engine_reports_it(tmp_path, monkeypatch):
    import shutil

    target = tmp_path / "target"
    shutil.copytree(TINY_TARGET, target)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (target / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("STUB_VLLM_KWARGS", str(tmp_path / "kwargs.json"))
    engine = VllmCapture(stub_engine(tmp_path), str(target), [0], 128, "bf16", 256, None)
    try:
        engine.start()
    finally:
        engine.close()
    given = json.loads((tmp_path / "kwargs.json").read_text())
    assert (given["tensor_parallel_size"], given["pipeline_parallel_size"], given["quantization"]) == (1, 1, None)
    record = engine.record
    assert (record["tensor_parallel"], record["quantization"], record["checkpoint_quantization"]) == (1, None, "fp8")


def test_a_store_refuses_a_rerun_with_another_engine_layout_before_any_shard_is_claimed(tmp_path, monkeypatch):
    from stages.extract.run import run as extract
    from store.errors import StoreMismatch
    from store.hidden_store import HiddenStore
    from store.summary import render, summarize
    from tests.targets import two_way_target

    monkeypatch.setenv("STUB_VLLM_KWARGS", str(tmp_path / "kwargs.json"))
    settings = dict(STORE_SETTINGS, store=str(tmp_path / "hs.zarr"), taps="1,3", capture="vllm")
    settings["target"] = str(two_way_target(tmp_path / "two_way"))  # heads that split over two ranks
    settings.update(capture_python=stub_engine(tmp_path), shards="0", capture_tp=2)
    extract(ExtractConfig(**settings), log=lambda m: None)
    store = HiddenStore(settings["store"])
    capture = store.attrs.compat.capture
    assert (capture["tensor_parallel"], capture["pipeline_parallel"], capture["quantization"]) == (2, 1, None)
    assert "tensor parallel 2, pipeline parallel 1, quantization none" in render(summarize(store))
    for changed in (dict(capture_tp=1), dict(capture_quantization="fp8_per_block")):  # pp: the same record
        with pytest.raises(StoreMismatch, match=r"refusing to add shards \(capture: store has"):
            extract(ExtractConfig(**{**settings, "shards": "1", **changed}), log=lambda m: None)
        assert sorted(HiddenStore(settings["store"]).committed()) == [0]


def test_an_engine_that_loads_but_cannot_run_the_forward_is_one_line_before_the_store_is_made(tmp_path, monkeypatch):
    from stages.extract.run import run as extract

    monkeypatch.setenv("STUB_VLLM_KWARGS", str(tmp_path / "kwargs.json"))
    monkeypatch.setenv("STUB_VLLM_FORWARD_FAILS", "CHECK_EQ(mat1.size(1), K) failed. 128 vs 4")  # as vLLM's CPU FP8
    config = ExtractConfig(
        **dict(STORE_SETTINGS, store=str(tmp_path / "hs.zarr"), capture="vllm", capture_python=stub_engine(tmp_path))
    )
    with pytest.raises(
        EngineError, match=r"^--capture vllm: the engine stopped \(exit 1\): RuntimeError: CHECK_EQ"
    ) as e:
        extract(config, log=lambda m: None)
    kept_log(e.value)
    assert not (tmp_path / "hs.zarr").exists()


def test_a_drafter_is_refused_on_states_of_another_engine_layout():
    import dataclasses

    from store.format.schema import Compat

    fields = {f.name: "x" for f in dataclasses.fields(Compat)}
    one = Compat(**{**fields, "capture": {"engine": "vllm", "tensor_parallel": 1, "quantization": None}})
    for other in ({"tensor_parallel": 2}, {"quantization": "fp8_per_tensor"}):
        changed = dataclasses.replace(one, capture={**one.capture, **other})
        assert changed.conditioning() != one.conditioning() and changed.placement() == one.placement()


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
    for flag, value in (("capture_tp", 2), ("capture_pp", 2), ("capture_quantization", "fp8_per_tensor")):
        with pytest.raises(ConfigError, match=f"--{flag.replace('_', '-')}.*goes with --capture vllm"):
            ExtractConfig(device="cpu", **{flag: value})
    for flag in ("capture_tp", "capture_pp"):
        with pytest.raises(ConfigError, match=f"--{flag.replace('_', '-')}.*must be at least 1"):
            ExtractConfig(capture="vllm", device="cpu", **{flag: 0})
    with pytest.raises(ConfigError, match="--capture-quantization.*quantization method's name"):
        ExtractConfig(capture="vllm", capture_quantization="FP8 please", device="cpu")
    engine = ExtractConfig(capture="vllm", device="cpu")
    assert (engine.capture_tp, engine.capture_pp, engine.capture_quantization) == (1, 1, None)


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


def test_the_two_way_target_is_the_shipped_target_bit_for_bit(tmp_path, target_bf16):
    """The tensor-parallel tests' target (two Gated DeltaNet key heads, equal) computes what the
    shipped one does, so the TP 2 engine's states are held to the shipped target's."""
    from pipeline.target import loading
    from tests.targets import reference_states, two_way_target

    two_way = loading.load(str(two_way_target(tmp_path / "two_way")), "cpu", "bf16", "auto")
    assert two_way.model.config.linear_num_key_heads == 2 * target_bf16.model.config.linear_num_key_heads
    seq = list(range(5, 80))
    for a, b in zip(reference_states(target_bf16, seq), reference_states(two_way, seq), strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_a_tensor_parallel_size_that_does_not_split_the_heads_is_refused_before_the_engine_starts(tmp_path):
    from stages.extract.run import run as extract

    config = ExtractConfig(
        store=str(tmp_path / "hs.zarr"),
        capture="vllm",
        capture_python=fake_vllm(tmp_path, "0.32.0"),  # no engine in it: refused before one would start
        capture_tp=2,
        dtype="bf16",
        device="cpu",
    )
    with pytest.raises(ConfigError, match=r"^--capture-tp 2: must divide the target's linear_num_key_heads \(1\)"):
        extract(config, log=lambda m: None)
    assert not (tmp_path / "hs.zarr").exists()


@pytest.fixture(scope="module")
def tensor_parallel(captured, tmp_path_factory):
    """The sequences of `captured` through vLLM at tensor parallel 2 (the two-way target: the shipped
    one's function with heads that split in two), each rank's threads unbound (this host has one NUMA
    node, vLLM's automatic binding wants one a rank)."""
    from tests.engines import build_venv
    from tests.targets import two_way_target

    target = two_way_target(tmp_path_factory.mktemp("tp") / "two_way")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        engine = VllmCapture(str(build_venv()), str(target), TAPS, 128, "bf16", 256, 0.1, tensor_parallel=2).start()
        try:
            states, agreement = engine.capture(captured["seqs"], TAPS, captured["lens"])
        finally:
            engine.close()
    return {"vllm": states, "agreement": agreement, "record": engine.record}


@pytest.mark.engine
def test_tensor_parallel_2_states_equal_transformers_and_tensor_parallel_1_tap_for_tap(tensor_parallel, captured):
    tp2, tp1, hf = tensor_parallel["vllm"], captured["vllm"], captured["hf"]
    assert tp2.shape == hf.shape and tp2.dtype == torch.bfloat16
    assert not (tp2 == 0).all(dim=-1).any()
    for j, k in enumerate(TAPS):
        to_hf, to_tp1 = stats(tp2[:, j], hf[:, j]), stats(tp2[:, j], tp1[:, j])
        print(f"\ntap {k}: TP2 vs transformers " + ", ".join(f"{n} {v:.5f}" for n, v in to_hf.items()))
        print(f"tap {k}: TP2 vs TP1 " + ", ".join(f"{n} {v:.5f}" for n, v in to_tp1.items()))
        assert equal(to_hf) and equal(to_tp1), (k, to_hf, to_tp1)
    record = tensor_parallel["record"]
    assert (record["tensor_parallel"], record["pipeline_parallel"], record["quantization"]) == (2, 1, None)
    (matches, tokens), (hf_matches, hf_tokens) = tensor_parallel["agreement"], captured["agreement"][1]
    print(f"agreement: TP2 {matches}/{tokens}, transformers {hf_matches}/{hf_tokens}")
    assert tokens == hf_tokens and abs(matches - hf_matches) <= 2


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


def trained(store: Path, run_dir: Path) -> Path:
    """A drafter trained 60 steps on `store`, shard 1 held out, in run_dir."""
    from stages.train.config import TrainConfig
    from stages.train.run import run as train

    config = TrainConfig.of(store=str(store), out=str(run_dir), eval_shards="1", max_steps=60, batch_size=4, anchors=32)
    train(config, log=lambda m: None)
    return run_dir


@pytest.mark.engine
def test_a_drafter_trained_on_engine_states_is_refused_on_transformers_states_and_replays_alike(stores):
    """Refused without --allow-mismatch; with it, the same replay tau within TAU_TOLERANCE."""
    from pipeline.errors import DrafterError
    from stages.evaluate.config import EvalConfig
    from stages.evaluate.run import run as evaluate

    run_dir = trained(stores["vllm"], stores["root"] / "run")

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


FP8 = "fp8_per_block"  # the one online FP8 scheme vLLM 0.32's CPU build runs (docs/extraction.md, vLLM capture)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """Shards 0-1 of the shipped prompts on the FP8-ready tiny target (tests/targets.fp8_block_target),
    captured by transformers (bf16), by vLLM in bf16 and by vLLM with its weights in FP8."""
    from stages.extract.run import run as extract
    from tests.engines import build_venv
    from tests.targets import fp8_block_target

    root = tmp_path_factory.mktemp("fp8")
    settings = dict(STORE_SETTINGS, target=str(fp8_block_target(root / "target")))
    engine = dict(capture="vllm", capture_python=str(build_venv()), capture_memory=0.1)
    out = {"root": root}
    for name, extra in (("hf", {}), ("bf16", engine), ("fp8", dict(engine, capture_quantization=FP8))):
        out[name] = root / f"{name}.zarr"
        extract(ExtractConfig(store=str(out[name]), **settings, **extra), log=print)
    return out


@pytest.mark.engine
def test_an_fp8_capture_records_its_quantization_and_moves_the_states_beyond_bf16_rounding(quantized):
    from bench.parity import per_tap
    from store.hidden_store import HiddenStore
    from store.summary import render, summarize

    hf, bf16, fp8 = (HiddenStore(str(quantized[n])) for n in ("hf", "bf16", "fp8"))
    capture = fp8.attrs.compat.capture
    assert (capture["quantization"], capture["checkpoint_quantization"]) == (FP8, None)
    assert "CPUFp8BlockScaledMMKernel" in capture["kernels"]["linear"]
    assert bf16.attrs.compat.capture["quantization"] is None
    assert f"quantization {FP8}" in render(summarize(fp8))
    assert fp8.attrs.compat.conditioning() != bf16.attrs.compat.conditioning()
    assert fp8.attrs.compat.placement() == bf16.attrs.compat.placement()
    for row in per_tap(hf, bf16)["taps"]:  # the engine in bf16 on this target: bf16 rounding, as on the shipped one
        assert row["cos_min"] >= COS_MIN and row["max_abs"] <= MAX_ABS and row["bit_identical"] >= SAME, row
    figures = per_tap(hf, fp8)
    print(f"\n{FP8} against transformers bf16, {figures['tokens']} tokens:")
    for row in figures["taps"]:
        print({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()})
    rows = figures["taps"]
    assert min(r["cos_mean"] for r in rows) >= FP8_COS_MEAN  # the same states, FP8-rounded weights
    assert any(r["cos_min"] < COS_MIN or r["bit_identical"] < SAME for r in rows)  # not bf16 parity


@pytest.mark.engine
def test_a_drafter_trained_on_bf16_engine_states_is_refused_on_fp8_states_unless_allowed(quantized):
    from pipeline.errors import DrafterError
    from stages.evaluate.config import EvalConfig
    from stages.evaluate.run import run as evaluate

    run_dir = trained(quantized["bf16"], quantized["root"] / "run")

    def replay(store: str, allow: bool) -> dict:
        config = EvalConfig(
            store=str(quantized[store]),
            checkpoints=(str(run_dir / "final"),),
            shards="1",
            out=str(quantized["root"] / f"eval-{store}-{allow}"),
            ddtree=(),
            max_prompts=10,
            allow_mismatch=allow,
            device="cpu",
        )
        return evaluate(config, log=lambda m: None)["checkpoints"][0]

    same = replay("bf16", False)
    with pytest.raises(DrafterError, match="not trained on this store's conditioning"):
        replay("fp8", False)
    other = replay("fp8", True)
    assert other["check"].startswith("mismatch (allowed)")
    print(f"\nchain tau: on the bf16 engine store {same['tau']:.4f}, on the {FP8} store {other['tau']:.4f}")


def opt_target(directory: Path) -> Path:
    """A tiny OPT (random weights, the tiny target's tokenizer): a decoder the project taps, of an
    architecture vLLM serves whose model class lacks SupportsEagle3, so extract_hidden_states cannot
    take its layers' states."""
    import shutil

    from transformers import OPTConfig, OPTForCausalLM

    from pipeline import TINY_TARGET

    torch.manual_seed(0)
    config = OPTConfig(
        vocab_size=4096,
        hidden_size=128,
        word_embed_proj_dim=128,
        ffn_dim=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=8192,  # the default --max-length's prefill and more
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    OPTForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TINY_TARGET / name, directory / name)
    return directory


def stub_vllm_without_eagle3(tmp_path) -> tuple[str, Path]:
    """A Python whose `vllm` 0.32.0 resolves any target to a model class without SupportsEagle3, and
    whose engine, if it were ever started, leaves a file (the second path)."""
    where = tmp_path / "vllm-no-eagle3"
    started = where / "engine-started"
    (where / "vllm").mkdir(parents=True, exist_ok=True)
    (where / "vllm" / "__init__.py").write_text(
        f"__version__ = '0.32.0'\n\ndef LLM(**kw):\n    open({str(started)!r}, 'w').close()\n"
    )
    resolving_to(where, "OPTForCausalLM", eagle3=False)
    return shim(where), started


def resolving_to(where: Path, model_class: str, eagle3: bool) -> None:
    """The parts of a stub `vllm` under `where` that the worker's check before the engine starts reads:
    EngineArgs resolving any target to `model_class`, which has SupportsEagle3 or not."""
    files = {
        "vllm/engine/__init__.py": "",
        "vllm/engine/arg_utils.py": (
            f"class {model_class}:\n    supports_eagle3 = {eagle3}\n\n\n"
            "class Registry:\n    def resolve_model_cls(self, archs, config):\n"
            f"        return {model_class}, archs[0]\n\n\n"
            f"class ModelConfig:\n    architectures = [{model_class!r}]\n    registry = Registry()\n\n\n"
            "class EngineArgs:\n    def __init__(self, **kw):\n        pass\n\n"
            "    def create_model_config(self):\n        return ModelConfig()\n"
        ),
        "vllm/model_executor/__init__.py": "",
        "vllm/model_executor/models/__init__.py": "",
        "vllm/model_executor/models/interfaces.py": (
            "def supports_eagle3(model):\n    return getattr(model, 'supports_eagle3', False)\n"
        ),
    }
    for name, text in files.items():
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        (where / name).write_text(text)


def shim(where: Path) -> str:
    """A `python` that runs this interpreter with the stub packages under `where` first on its path."""
    python = where / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={where} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return str(python)


UNCAPTURABLE = (
    r"^--capture vllm: vLLM serves OPTForCausalLM as OPTForCausalLM, which cannot hand out its layers' "
    r"hidden states \(no set_aux_hidden_state_layers, .*\) \(log /\S+\)$"
)


def test_an_architecture_the_engine_cannot_capture_is_one_line_before_its_engine_starts_or_a_shard_is_claimed(
    tmp_path,
):
    from stages.extract.run import run as extract

    python, started = stub_vllm_without_eagle3(tmp_path)
    config = ExtractConfig(
        store=str(tmp_path / "hs.zarr"),
        target=str(opt_target(tmp_path / "opt")),
        capture="vllm",
        capture_python=python,
        taps="0,1",
        dtype="bf16",
        device="cpu",
    )
    with pytest.raises(EngineError, match=UNCAPTURABLE) as refused:
        extract(config, log=lambda m: None)
    kept_log(refused.value)
    assert not started.exists()  # the engine never started: no weight was loaded
    assert not (tmp_path / "hs.zarr").exists()  # nothing claimed, not even the store's root


def unserved_target(directory: Path) -> Path:
    """The shipped tiny target under an architecture name no one serves: transformers builds it from
    its model_type, vLLM has no class of that name."""
    import shutil

    from pipeline import TINY_TARGET

    shutil.copytree(TINY_TARGET, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "architectures": ["FooForCausalLM"]}))
    return directory


@pytest.mark.engine
@pytest.mark.parametrize(
    "make, refusal",
    [
        (opt_target, UNCAPTURABLE),
        (
            unserved_target,
            r"^--capture vllm: vLLM refuses \S+: Model architectures \['FooForCausalLM'\] are not "
            r"supported for now \(log /\S+\)$",
        ),
    ],
    ids=["served-without-aux-states", "not-served"],
)
def test_vllm_refuses_an_architecture_it_cannot_capture_in_one_line_before_loading_it(tmp_path, make, refusal):
    """The real vLLM: its OPTForCausalLM returns no aux hidden states (its engine would load the
    weights first, then stop with RuntimeError 'Model does not support EAGLE3 interface'), and it
    serves no FooForCausalLM. Each refused from the target's config, before the engine starts and
    before the store exists."""
    import time

    from stages.extract.run import run as extract
    from tests.engines import build_venv

    config = ExtractConfig(
        store=str(tmp_path / "hs.zarr"),
        target=str(make(tmp_path / "target")),
        capture="vllm",
        capture_python=str(build_venv()),
        taps="0,1",
        dtype="bf16",
        device="cpu",
        max_length=256,
    )
    t = time.perf_counter()
    with pytest.raises(EngineError, match=refusal) as refused:
        extract(config, log=print)
    print(f"\nrefused in {time.perf_counter() - t:.1f}s: {refused.value}")
    log = Path(re.search(r"\(log (/\S+)\)$", str(refused.value)).group(1)).read_text()
    kept_log(refused.value)
    assert not (tmp_path / "hs.zarr").exists()
    assert "EngineCore" not in log  # no engine process was started


def test_under_a_launcher_each_engine_gets_its_own_gpus_and_none_of_the_launchers_variables():
    from stages.extract.engine_capture import engine_env

    launched = {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "3",
        "MASTER_ADDR": "n0",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "x",
        "HF_HOME": "/hf",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    alone = engine_env({"HF_HOME": "/hf"}, "cuda:0", 1, 8, 8)
    assert alone == {"HF_HOME": "/hf"}  # one process: the engine sees what it sees (TP 8 over all)
    one_each = engine_env(launched, "cuda:3", 8, 1, 8)
    assert one_each == {"HF_HOME": "/hf", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "CUDA_VISIBLE_DEVICES": "3"}
    halves = engine_env({**launched, "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, "cuda:1", 2, 2, 4)
    assert halves["CUDA_VISIBLE_DEVICES"] == "6,7"  # rank 1's two of the four this process may use
    assert engine_env(launched, "cpu", 8, 2, 0) == {"HF_HOME": "/hf", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    with pytest.raises(EngineError, match=r"^--capture vllm: the engine of local rank 3 needs GPUs 6-7 .* sees 4; "):
        engine_env({**launched, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "cuda:3", 8, 2, 8)
