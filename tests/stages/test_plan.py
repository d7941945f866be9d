"""stages/plan: `pipeline plan`'s figures for the documented 27B run from the named architecture, each
refusal in one line, a target directory read for its config alone, the memory model's parts, and the
block docs/scale.md shows is what the command prints."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

from pipeline import TINY_TARGET
from pipeline.errors import PlanError
from stages.plan import memory
from stages.plan.config import PlanConfig, low_high
from stages.plan.report import render
from stages.plan.run import GB, TB, drafter_config, drafter_parameters, run, training_flops
from store.errors import ConfigError
from tests.conftest import REPO


def test_the_27b_run_as_documented():
    """The defaults are docs/scale.md's run: 2.5M rows of 1,000 + 1,000 tokens, fp8, 4 nodes of 8 GPUs."""
    plan = run(PlanConfig())
    assert plan.parameters == 26_895_998_464 and plan.shape.drafter_parameters == 1_730_213_120
    assert (plan.shards, plan.training_shards) == (2_442, 2_400)
    assert plan.raw == 5_000_000_000 * 5 * 5_120 * 2  # 256.0 TB
    assert [round(s / TB, 1) for s in plan.stored] == [89.2, 105.0]
    assert [round(s / TB, 1) for s in plan.share] == [21.9, 25.8]
    assert plan.cache == 27 * TB
    assert round(plan.rates["capture"].low) == 7_436 and plan.rates["capture"].kind == "arithmetic"
    assert round(plan.rates["training"].low, 2) == 2.83
    assert plan.rates["writer"].kind == "measured" and (REPO / plan.rates["writer"].source).is_file()
    assert [round(h) for h in plan.hours["capture"]] == [187, 187]
    assert [round(h) for h in plan.hours["references"]] == [214, 353]
    assert [round(h) for h in plan.hours["training"]] == [1_448, 1_448]
    assert round(plan.hours["training"][0] / 32, 1) == 45.2


def test_bf16_doubles_the_store():
    plan = run(PlanConfig(hidden_format="bf16", nodes=8))
    assert round(plan.stored[0] / TB, 1) == 166.6 and plan.stored[0] == plan.stored[1]


def test_the_final_state_is_one_more_state_stored_read_and_held():
    """--final-state: 6 states a token at 5 taps; the sample's final states in training memory; the target's
    logits over the labels twice (forward, recomputed); the documented 4 nodes' cache no longer holds a share."""
    with pytest.raises(PlanError, match=r"share of the store, up to 30.9 TB, is larger than its cache, 27.0 TB"):
        run(PlanConfig(final_state=True))
    plain, final = run(PlanConfig(nodes=5)), run(PlanConfig(nodes=5, final_state=True))
    assert final.raw * 5 == plain.raw * 6 and final.stored[1] * 5 == plain.stored[1] * 6
    s, tokens = plain.shape, 2_000
    grown = final.memory["training"]["sample states + fc"] - plain.memory["training"]["sample states + fc"]
    assert grown == tokens * s.hidden * 2
    head = 2 * s.hidden * s.vocab * 512 * 15
    assert training_flops(final.config, s) - training_flops(plain.config, s) == 2 * head
    assert "6 x 5,120 x 2 B = 61,440 B a token" in render(final) and "5 taps + the final state" in render(final)


def test_a_dspark_head_adds_its_markov_matrices_and_their_bias():
    """--head dspark: two [V, r] matrices and the confidence head's row among the trainable parameters; a
    bias of r values a label row in training's FLOPs (the lookup costs none)."""
    plain, dspark = run(PlanConfig()), run(PlanConfig(head="dspark", markov_rank=256))
    V, H = plain.shape.vocab, plain.shape.hidden
    assert dspark.shape.drafter_parameters - plain.shape.drafter_parameters == 2 * V * 256 + H + 256 + 1
    bias = 2 * 256 * V * 512 * 15
    assert training_flops(dspark.config, dspark.shape) - training_flops(plain.config, plain.shape) == 3 * bias
    assert "head dspark (Markov rank 256, muon)" in render(dspark) and "1.73B trainable parameters" in render(plain)


def test_markov_matrices_on_adamw_keep_two_moments_on_every_gpu():
    """--markov-optimizer adamw: the 2 x [V, r] Markov matrices hold AdamW's two fp32 moments on every GPU
    (and its step's two temporaries) where Muon keeps 1/processes of a momentum (and one bf16 update)."""
    muon = run(PlanConfig(head="dspark", markov_rank=256))
    adamw = run(PlanConfig(head="dspark", markov_rank=256, markov_optimizer="adamw"))
    n, gpus = 2 * muon.shape.vocab * 256, 32
    grown = {k: adamw.memory["training"][k] - muon.memory["training"][k] for k in muon.memory["training"]}
    assert abs(grown["trainable states"] - n * 4 * (2 - 1 / gpus)) <= 2  # two moments against 1/32 of a momentum
    assert grown["optimizer step"] == n * (2 * 4 - 2)
    assert {k for k, v in grown.items() if v} == {"trainable states", "optimizer step"}
    assert "(Markov rank 256, adamw)" in render(adamw)
    with pytest.raises(ConfigError, match="--markov-optimizer.*only used by --optimizer muon"):
        PlanConfig(optimizer="adamw", markov_optimizer="adamw")


def test_the_capture_batch_fills_the_gpu_beside_the_weights():
    """The batch is the most tokens whose capture forward fits: one more does not."""
    plan = run(PlanConfig())
    gpu = 80 * GB
    assert memory.total(memory.capture(plan.shape, plan.weights, plan.capture_tokens, cpu=False)) <= gpu
    assert memory.total(memory.capture(plan.shape, plan.weights, plan.capture_tokens + 1, cpu=False)) > gpu
    bigger = run(PlanConfig(gpu_memory_gb=141))
    assert bigger.capture_tokens > 2.5 * plan.capture_tokens


def test_the_memory_model_grows_with_its_inputs():
    plan = run(PlanConfig())
    s = plan.shape
    one, two = (memory.total(memory.capture(s, plan.weights, t, cpu=False)) for t in (2_000, 3_000))
    layer = (3 * s.intermediate + 4 * s.hidden) * 2
    assert two - one == 1_000 * (s.hidden * 2 + layer)  # a GPU holds one tap at a time: the rest is on the host
    one, two = (memory.total(memory.capture(s, plan.weights, t, cpu=True)) for t in (2_000, 3_000))
    assert two - one == 1_000 * (2 * s.taps * s.hidden * 2 + layer)  # on CPU the host buffers and their stack
    muon, adamw = (memory.training(s, o, 2_000, 512, 16, cpu=False) for o in ("muon", "adamw"))
    assert adamw["trainable states"] - muon["trainable states"] == 4 * s.drafter_parameters
    split = memory.training(s, "muon", 2_000, 512, 16, cpu=False, processes=32)
    assert muon["trainable states"] - split["trainable states"] == 4 * s.drafter_parameters * 31 // 32  # by owner
    gpu, cpu = (
        memory.training(s, "muon", 2_000, 512, 16, cpu=False),
        memory.training(s, "muon", 2_000, 512, 16, cpu=True),
    )
    assert cpu["frozen embed + lm_head"] == 2 * gpu["frozen embed + lm_head"] and "runtime" in cpu


def test_the_drafter_count_is_the_released_configs():
    assert drafter_parameters(drafter_config(5_120, 248_320, 5, 5, 16)) == 1_730_213_120


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (dict(gpu_memory_gb=40), "--target qwen3.6-27b: 53.8 GB of bf16 weights do not fit a GPU of 40 GB"),
        (dict(hidden_format="bf16"), "--hidden-format bf16: a node's share of the store, up to 40.9 TB, is larger"),
        (dict(gpu_memory_gb=54), "--gpu-memory-gb 54: a capture forward of one 2,000-token sample needs"),
        (dict(anchors=4_096), "--gpu-memory-gb 80: training needs 82.8 GB"),
        (dict(target="/nonexistent/model"), "--target /nonexistent/model: neither a directory nor an architecture"),
        (dict(rows=1_000), "--eval-shards 42: leaves -41 of 1 shards for 4 nodes"),
    ],
)
def test_a_plan_that_does_not_fit_is_refused_in_one_line(change, says):
    with pytest.raises(PlanError) as e:
        run(PlanConfig(**change))
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("field", "value"), [("rows", 0), ("cache_share", 1.5), ("decode_tokens_s", (5_000.0, 2_500.0)), ("nodes", 0)]
)
def test_bad_settings_name_their_flag(field, value):
    with pytest.raises(ConfigError, match="--" + field.replace("_", "-")):
        PlanConfig(**{field: value})


def test_a_rate_range_is_low_high():
    assert low_high("2500-5000") == (2_500.0, 5_000.0) and low_high("3000") == (3_000.0, 3_000.0)
    for text in ("abc", "5000-100", "0-10", "1-2-3"):
        with pytest.raises(ValueError, match="expected LOW-HIGH"):
            low_high(text)


def test_a_target_directory_is_read_for_its_config():
    """The shipped tiny target: its parameters as its weights count them, its widths in the plan."""
    plan = run(PlanConfig(target=str(TINY_TARGET), rows=8_192, eval_shards=4, nodes=2, local_disk_tb=1))
    assert plan.name == "tiny_target" and plan.parameters == 2_764_440
    assert (plan.shape.hidden, plan.shape.vocab) == (128, 4_096)
    assert plan.raw == 8_192 * 2_000 * 5 * 128 * 2


def test_the_command_line(tmp_path):
    """`pipeline plan` prints the plan; a refusal is one `error:` line and exit 2, like every command."""
    ok = subprocess.run([sys.executable, "-m", "pipeline", "plan"], cwd=REPO, capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip() == render(run(PlanConfig())).strip()
    for line in ("raw            256.0 TB", "training       1,448 GPU-h, 45.2 h", "capture        187 GPU-h"):
        assert line in ok.stdout
    assert re.search(r"capture +[\d,.]+ tokens/s \(arithmetic", ok.stdout)
    assert re.search(r"writer +591 MB/s raw a process \(measured: bench/results/fp8_cpu.json\)", ok.stdout)
    bad = subprocess.run(
        [sys.executable, "-m", "pipeline", "plan", "--hidden-format", "bf16"], cwd=REPO, capture_output=True, text=True
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("error: --hidden-format bf16: a node's share") and bad.stderr.count("\n") == 1
    helped = subprocess.run(
        [sys.executable, "-m", "pipeline", "plan", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert all(f"--{f}" in helped.stdout for f in ("target", "rows", "gpu-memory-gb", "local-disk-tb", "network-gbps"))


def test_the_documented_27b_plan_is_the_commands_output():
    """docs/scale.md's 27B section holds `pipeline plan`'s output as tools/doc_tables.py writes it."""
    spec = importlib.util.spec_from_file_location("doc_tables", REPO / "tools" / "doc_tables.py")
    doc_tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(doc_tables)
    text = (REPO / "docs" / "scale.md").read_text()
    found = [(m, body) for m, body in doc_tables.tables(text) if m.group(1) == "plan"]
    assert len(found) == 1 and found[0][0].group(3) == found[0][1]
    section = text.split("## A 27B run on an object store", 1)[1]
    assert section.index("<!-- plan:") < section.index("**1. Extract")
    assert "    training       1,448 GPU-h, 45.2 h" in found[0][1]
    with pytest.raises(ValueError, match="is refused: --target qwen3.6-27b: 53.8 GB of bf16 weights do not fit"):
        doc_tables.plan_block(["--gpu-memory-gb", "40"])
