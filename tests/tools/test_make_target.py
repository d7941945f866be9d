"""tools/make_target.py: real-shaped targets from published architectures, with deterministic random
weights. The default tests build shrunken copies of the published configs (narrow, full vocabulary)
through the same `build`; `pytest -m real_width` builds Qwen3.6-27B at 4 layers, full width, on CPU and
runs extraction, a few training steps and evaluation on it."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from pipeline import DEFAULT_PROMPTS, TINY_TARGET
from pipeline.target.architectures import ARCHS, Arch
from stages.plan import memory
from tests.conftest import REPO, SMALL

sys.path.insert(0, str(REPO / "tools"))
try:
    import make_target
finally:
    sys.path.pop(0)

NARROW = {  # every width shrunk, the vocabulary and the layer pattern as published
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}
NARROW_MOE = {  # and a smaller vocabulary: the dense builds check the full one
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "vocab_size": 8192,
}


def shrunk(name: str, layers: int = 8, **more) -> Arch:
    """A published architecture at `layers` layers and narrow widths (RoPE sections fitted to the head)."""
    arch = ARCHS[name]
    rope = {**arch.config["rope_parameters"], "mrope_section": [1, 1, 2]}
    return dataclasses.replace(
        arch, config={**arch.config, **NARROW, **more, "num_hidden_layers": layers, "rope_parameters": rope}
    )


def weights(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("model-*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Shrunken Qwen3.6-27B (8 layers) built at 4 layers, in small shards."""
    out = tmp_path_factory.mktemp("targets") / "q36-4l"
    make_target.build(shrunk("qwen3.6-27b"), out, layers=4, seed=0, device="cpu", max_shard_gb=0.02, log=lambda m: None)
    return out


def test_the_published_numbers():
    """The table holds the numbers of the releases (pipeline/target/architectures.py names each source)."""
    q36 = ARCHS["qwen3.6-27b"].text_config(64)
    assert {k: q36[k] for k in ("model_type", "hidden_size", "intermediate_size", "vocab_size")} == {
        "model_type": "qwen3_5_text",
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "vocab_size": 248320,
    }
    assert (q36["num_attention_heads"], q36["num_key_value_heads"], q36["head_dim"]) == (24, 4, 256)
    assert (q36["linear_num_key_heads"], q36["linear_num_value_heads"], q36["linear_key_head_dim"]) == (16, 48, 128)
    assert q36["linear_value_head_dim"] == 128 and q36["linear_conv_kernel_dim"] == 4
    assert q36["rope_parameters"]["partial_rotary_factor"] == 0.25 and q36["rope_parameters"]["rope_theta"] == 1e7
    assert q36["rms_norm_eps"] == 1e-6 and q36["attn_output_gate"] and not q36["tie_word_embeddings"]
    assert [i for i, t in enumerate(q36["layer_types"]) if t == "full_attention"] == list(range(3, 64, 4))
    assert ARCHS["qwen3.5-9b"].full_layers == 32 and ARCHS["qwen3.5-35b-a3b"].full_layers == 40
    assert ARCHS["qwen3.5-35b-a3b"].model_type == "qwen3_5_moe_text"


def test_the_full_models_count_as_published():
    """The checkpoint's tensors at full depth, listed on the meta device (nothing allocated): the MoE's
    text decoder holds 34,660,610,688 parameters, the figure public descriptions of Qwen3.5-35B-A3B give;
    Qwen3.6-27B's text model is 53.8 GB in bf16."""
    for name, parameters in (("qwen3.5-35b-a3b", 34_660_610_688), ("qwen3.6-27b", 26_895_998_464)):
        arch = ARCHS[name]
        tensors, _ = make_target.checkpoint_tensors(make_target.hf_config(arch, arch.full_layers))
        assert sum(t.nbytes for t in tensors) == 2 * parameters, name


def test_same_arguments_give_the_same_bytes(built, tmp_path):
    again = tmp_path / "again"
    make_target.build(
        shrunk("qwen3.6-27b"), again, layers=4, seed=0, device="cpu", max_shard_gb=0.02, log=lambda m: None
    )
    files = sorted(p.name for p in built.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    assert sum(name.startswith("model-0000") for name in files) == 3  # sharded, as --max-shard-gb asked
    for name in files:
        if name != make_target.RECORD:  # the record names its own directory
            assert (built / name).read_bytes() == (again / name).read_bytes(), name


def test_a_tensor_depends_on_the_seed_and_its_name_only(built, tmp_path):
    """The full-depth build holds the reduced build's tensors, bit for bit; another seed changes them."""
    full = tmp_path / "full"
    make_target.build(shrunk("qwen3.6-27b"), full, seed=0, device="cpu", log=lambda m: None)
    reduced, whole = weights(built), weights(full)
    assert set(reduced) < set(whole)
    assert all(torch.equal(reduced[k], whole[k]) for k in reduced)
    other = tmp_path / "seed1"
    make_target.build(shrunk("qwen3.6-27b", layers=1), other, seed=1, device="cpu", log=lambda m: None)
    assert not torch.equal(weights(other)["model.embed_tokens.weight"], reduced["model.embed_tokens.weight"])


def test_the_layer_pattern_and_the_initialisation(built):
    config = json.loads((built / "config.json").read_text())
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert config["num_hidden_layers"] == 4 and config["vocab_size"] == 248320 and config["dtype"] == "bfloat16"
    assert config["architectures"] == ["Qwen3_5ForCausalLM"]
    w = weights(built)
    assert all(t.dtype == torch.bfloat16 for t in w.values())
    assert w["model.embed_tokens.weight"].shape == w["lm_head.weight"].shape == (248320, 64)
    assert abs(w["lm_head.weight"].float().std().item() - 0.02) < 1e-3
    assert not w["model.norm.weight"].any() and not w["model.layers.3.self_attn.q_norm.weight"].any()  # x * (1 + w)
    assert (w["model.layers.0.linear_attn.norm.weight"] == 1).all()  # the gated norm is x * w
    assert (w["model.layers.0.linear_attn.dt_bias"] == 1).all()
    a = w["model.layers.0.linear_attn.A_log"].float().exp()
    assert ((a > 0.009) & (a < 16.1)).all()
    assert "model.layers.3.self_attn.q_proj.weight" in w and "model.layers.0.linear_attn.in_proj_qkv.weight" in w


def test_the_taps_record(built):
    record = json.loads((built / make_target.RECORD).read_text())
    assert {k: record[k] for k in ("arch", "full_layers", "layers", "seed", "device", "torch")} == {
        "arch": "qwen3.6-27b",
        "full_layers": 8,
        "layers": 4,
        "seed": 0,
        "device": "cpu",
        "torch": torch.__version__,
    }
    assert record["full_taps"] == [1, 2, 3, 4, 5] and record["taps"] == "0,1,2,3"
    assert record["extract"] == f"pipeline extract --target {built} --taps 0,1,2,3"
    assert make_target.reduced_taps(64, 64) == [1, 16, 31, 46, 61]  # full depth: the defaults
    assert make_target.reduced_taps(64, 32) == [0, 8, 15, 23, 30]
    assert make_target.reduced_taps(64, 16) == [0, 3, 7, 11, 15]
    assert make_target.reduced_taps(64, 8) == [0, 1, 3, 5, 7]
    assert make_target.reduced_taps(64, 5) == [0, 1, 2, 3, 4]  # moved apart: five taps, as on the full model
    assert make_target.reduced_taps(64, 4) == [0, 1, 2, 3]  # fewer layers than taps: every layer
    assert make_target.reduced_taps(64, 1) == [0]


def test_transformers_loads_it_strictly(built):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(built, dtype=torch.bfloat16, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    state, saved = model.state_dict(), weights(built)
    assert set(state) == set(saved) and all(torch.equal(state[k], saved[k]) for k in saved)


def test_the_project_loader_loads_it_and_it_runs(built):
    from pipeline.target import loading

    torch.set_flush_denormal(True)
    target = loading.load(str(built), "cpu", "bf16", "torch")
    assert (target.num_layers, target.vocab_size, target.hidden_size) == (4, 248320, 64)
    assert target.record.model_class.endswith("Qwen3_5ForCausalLM")
    assert target.record.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    with torch.inference_mode():
        logits = target.model(torch.tensor([[1, 5, 9, 4096, 248319]])).logits
    assert logits.shape == (1, 5, 248320) and torch.isfinite(logits).all()


def test_every_id_decodes_and_prompts_tokenize_as_the_tiny_target(built):
    from transformers import AutoTokenizer

    tok, tiny = AutoTokenizer.from_pretrained(built), AutoTokenizer.from_pretrained(TINY_TARGET)
    assert len(tok) == 248320
    assert (tok.eos_token, tok.pad_token, tok.mask_token) == ("<|im_end|>", "<|endoftext|>", "<|mask|>")
    texts = tok.batch_decode([[i] for i in range(len(tok))])
    assert all(texts) and texts[4096] == " tok4096" and texts[-1] == " tok248319"
    for line in DEFAULT_PROMPTS.read_text().splitlines()[:20]:
        text = tiny.apply_chat_template(json.loads(line)["messages"][:1], add_generation_prompt=True, tokenize=False)
        assert (
            tok.apply_chat_template(json.loads(line)["messages"][:1], add_generation_prompt=True, tokenize=False)
            == text
        )
        assert tok(text).input_ids == tiny(text).input_ids


def test_the_moe_is_built_with_one_tensor_an_expert_and_extracts(tmp_path):
    from pipeline.target import loading

    out = tmp_path / "moe"
    make_target.build(shrunk("qwen3.5-35b-a3b", **NARROW_MOE), out, layers=4, device="cpu", log=lambda m: None)
    names = json.loads((out / make_target.INDEX).read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    torch.set_flush_denormal(True)
    target = loading.load(str(out), "cpu", "bf16", "torch")
    assert type(target.model).__name__ == "Qwen3_5MoeForCausalLM" and target.num_layers == 4
    with torch.inference_mode():
        assert torch.isfinite(target.model(torch.tensor([[1, 5, 9]])).logits).all()
    from stages.extract.config import ExtractConfig
    from stages.extract.run import run

    store, taps = tmp_path / "hs.zarr", json.loads((out / make_target.RECORD).read_text())["taps"]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(DEFAULT_PROMPTS.read_text().splitlines(keepends=True)[:2]))
    small = {**SMALL, "max_new_tokens": 4, "batch_size": 2, "num_shards": 1}
    run(ExtractConfig(store=str(store), target=str(out), taps=taps, dataset=str(rows), **small), log=lambda m: None)
    from store.hidden_store import HiddenStore

    attrs = HiddenStore(str(store)).attrs
    assert attrs.taps == (0, 1, 2, 3) and attrs.target.model_class.endswith("Qwen3_5MoeForCausalLM")


def test_refusals_come_before_anything_is_written(tmp_path):
    arch = shrunk("qwen3.6-27b")
    with pytest.raises(make_target.Refused, match=r"--layers 9: qwen3.6-27b has 8 layers; choose 1-8"):
        make_target.build(arch, tmp_path / "a", layers=9)
    (tmp_path / "b").mkdir()
    with pytest.raises(make_target.Refused, match="already exists"):
        make_target.build(arch, tmp_path / "b")
    huge = dataclasses.replace(arch, config={**arch.config, "vocab_size": 10**12})  # ~256 TB of embedding
    with pytest.raises(make_target.Refused, match=r"needs [\d.]+ GB for its bf16 weights alone; [\d.]+ GB host memory"):
        make_target.build(huge, tmp_path / "c", device="cpu")
    small_vocab = dataclasses.replace(arch, config={**arch.config, "vocab_size": 1000})
    with pytest.raises(make_target.Refused, match="vocab_size 1000 is below the tiny tokenizer's 4096 tokens"):
        make_target.build(small_vocab, tmp_path / "d")
    assert [p.name for p in tmp_path.iterdir()] == ["b"]


def test_the_command_line(tmp_path):
    run = [sys.executable, str(REPO / "tools" / "make_target.py")]
    helped = subprocess.run([*run, "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and all(f in helped.stdout for f in ("--arch", "--layers", "--device", "--seed"))
    bad = subprocess.run([*run, "--arch", "qwen3.6-27b", "--layers", "0", "--out", tmp_path / "x"], capture_output=True)
    assert bad.returncode == 1 and bad.stderr.decode().strip() == (
        "error: --layers 0: qwen3.6-27b has 64 layers; choose 1-64"
    )


# ---- opt-in: real width (pytest -m real_width) ----

PEAK = (
    "import resource, subprocess, sys\n"
    "r = subprocess.run(sys.argv[1:])\n"
    "print(f'peak_rss_kb={resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}', file=sys.stderr)\n"
    "sys.exit(r.returncode)\n"
)


def stage(name: str, args: list, results: dict) -> None:
    """Run one command as a user would; record its wall time and its largest process's peak RSS."""
    t0 = time.time()
    r = subprocess.run(
        [sys.executable, "-c", PEAK, sys.executable, *map(str, args)],
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert r.returncode == 0, f"{name}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    peak = int(r.stderr.rsplit("peak_rss_kb=", 1)[1].split()[0])
    results[name] = {"wall_s": round(time.time() - t0, 1), "peak_rss_gib": round(peak / 2**20, 3)}
    print(f"{name}: {results[name]}", flush=True)


@pytest.mark.real_width
def test_qwen36_27b_at_four_layers_through_every_stage(tmp_path):
    """Qwen3.6-27B at 4 layers (hidden 5,120, vocabulary 248,320: 8.1 GB of bf16 weights), on CPU: built,
    extracted (the 2 shortest shipped prompts, one a shard, 8 new tokens each), trained for 2 steps and
    replayed for 4 rounds; each stage's peak RSS within 15% of stages/plan/memory.py's model.
    The drafter: 1 layer, 8 heads / 2 KV heads of 128, MLP 2048 (149M trainable
    parameters with fc), 4 anchors a sample, AdamW: Muon's orthogonalisation of fc (5,120 x 20,480) alone
    is several TFLOP a step, minutes on a CPU. Prints each stage's wall time and largest process's peak
    RSS, and writes them to real_width.json in the test's directory."""
    results: dict = {}
    target, store, run, report = (tmp_path / n for n in ("q36-4l", "hs.zarr", "run", "report"))
    build = ["tools/make_target.py", "--arch", "qwen3.6-27b", "--layers", 4, "--out", target, "--device", "cpu"]
    stage("build", build, results)
    record = json.loads((target / make_target.RECORD).read_text())
    assert record["taps"] == "0,1,2,3"
    rows = sorted((json.loads(x) for x in DEFAULT_PROMPTS.read_text().splitlines()), key=lambda r: len(json.dumps(r)))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    extract = ["-m", "pipeline", "extract", "--store", store, "--target", target, "--taps", record["taps"]]
    extract += ["--dataset", prompts, "--num-shards", 2, "--max-length", 96, "--max-new-tokens", 8]
    stage("extract", [*extract, "--batch-size", 1, "--device", "cpu"], results)
    from store.hidden_store import HiddenStore

    attrs = HiddenStore(str(store)).attrs
    assert (attrs.hidden_size, attrs.vocab_size, attrs.taps) == (5120, 248320, (0, 1, 2, 3))
    drafter = ["--num-layers", 1, "--num-heads", 8, "--num-kv-heads", 2, "--head-dim", 128, "--intermediate-size", 2048]
    train = ["train.py", "--store", store, "--out", run, "--shards", 0, "--eval-shards", 1, "--max-steps", 2]
    stage("train", [*train, *drafter, "--anchors", 4, "--optimizer", "adamw", "--workers", 1], results)
    evaluate = ["evaluate.py", "--store", store, "--checkpoint", run / "final", "--out", report, "--device", "cpu"]
    stage("evaluate", [*evaluate, "--ddtree", 8, "--max-rounds", 4], results)
    replayed = json.loads((report / "report.json").read_text())["checkpoints"][0]
    assert replayed["check"] == "store fingerprint matches" and replayed["prompts"] == 1 and replayed["rounds"] >= 1
    predicted = predicted_peaks(target, tokens=max(shard_tokens(store)))
    for name, parts in predicted.items():
        results[name]["predicted_gib"] = round(memory.total(parts) / 2**30, 3)
        results[name]["ratio"] = round(results[name]["peak_rss_gib"] / results[name]["predicted_gib"], 3)
    (tmp_path / "real_width.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results), flush=True)
    for name in predicted:  # the memory model of stages/plan/memory.py, on CPU: peak RSS within 15%
        assert 0.85 <= results[name]["ratio"] <= 1.15, (name, results[name], predicted[name])


def shard_tokens(store) -> list[int]:
    """Tokens of each committed shard (one sample a shard here)."""
    from store.hidden_store import HiddenStore

    return [c.tokens for c in HiddenStore(str(store)).committed().values()]


def predicted_peaks(target, tokens: int) -> dict[str, dict[str, int]]:
    """The memory model's peak for each stage as the test runs it: the 4-layer target's weights, the
    1-layer drafter of 4 taps (8 heads / 2 KV heads of 128, MLP 2048), AdamW, 4 anchors, one prompt."""
    from pipeline.target.parameter_count import read_config, weight_bytes
    from stages.plan.run import drafter_config, drafter_parameters

    config = read_config(target)
    h, v = config["hidden_size"], config["vocab_size"]
    sizes = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=128, intermediate_size=2048)
    drafter = drafter_parameters(dataclasses.replace(drafter_config(h, v, 4, 1, 16), **sizes))
    shape = memory.Shape(
        hidden=h,
        intermediate=config["intermediate_size"],
        vocab=v,
        taps=4,
        drafter_layers=1,
        drafter_q=1024,
        drafter_kv=256,
        drafter_intermediate=2048,
        drafter_parameters=drafter,
    )
    return {
        "extract": memory.capture(shape, weight_bytes(config), tokens, cpu=True),
        "train": memory.training(shape, "adamw", tokens, 4, 16, cpu=True),
        "evaluate": memory.replay(shape, 1, tokens, 16, cpu=True),
    }
