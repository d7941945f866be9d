"""Golden numbers: what the tiny target's store holds and what 20 training steps on it give, checked
against tests/data/golden_tiny_run.json, so that a change meant to keep behaviour (a refactor, a
dependency bump) is shown to keep it, and a change that moves a number is a reviewed change of the
asset. CPU, one thread, the torch README pins; the figures must hold on any x86-64 CPU.

Exact (the same on every CPU path measured): the CRC-32 of each shard's tokens, loss masks, offsets,
row ids, prompt lengths and first pairs, the store's fingerprint, and the held-out streak and replayed
taus. Within tests/golden.py's TOLERANCE (relative): the states, through sums per shard and tap (their
bf16 values differ from one CPU to another by one rounding step in a few values, so their CRC-32s
differ), the 20 training losses and the final held-out loss. How the tolerances were measured: on an
AVX2 machine (AMD EPYC), its default path and the paths forced by ATEN_CPU_CAPABILITY=default,
ONEDNN_MAX_CPU_ISA=SSE41 and MKL_CBWR=COMPATIBLE (each moves the numbers; the AVX2 and SSE4_2 settings
of the others do not), and the asset's earlier AVX-512 figures (kept in the asset under
`also_measured`): 10 CPU points. Each tolerance is the widest spread over every pair of them times 10,
rounded up (states 2.9e-6 -> 5e-5, losses 2.8e-5 -> 5e-4, held-out loss 4.7e-6 -> 5e-5); the streak
and replayed taus did not move at all. Real changes lie far past (taps shifted by one: states 0.48;
another learning rate, number of anchors or seed: losses 0.072 or more, held-out loss 0.0085 or more, and
the taus move): bench/reports/cross_cpu_cpu_2026-12-05.md, measured again by
`python -m bench.cross_cpu_bench`. The tests below show it on the stored states.

When a change moves them on purpose, rewrite the asset and say why in the commit (it records the CPU
that wrote it, and keeps earlier points of other CPUs that still hold):

    DFLASH_WRITE_GOLDEN=1 pytest tests/test_golden.py
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import zarr

from tests import golden

GOLDEN = Path(__file__).parent / "data" / "golden_tiny_run.json"


def test_the_golden_numbers_hold(small_store, tmp_path):
    got = golden.measure(small_store, tmp_path / "run")
    if os.environ.get("DFLASH_WRITE_GOLDEN"):
        new, dropped = golden.rewritten(json.loads(GOLDEN.read_text()) if GOLDEN.exists() else None, got)
        GOLDEN.write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
        pytest.skip(
            f"wrote {GOLDEN} on {golden.describe(got['cpu'])}"
            + (f", dropping the points that no longer hold: {dropped}" if dropped else "")
            + ": commit it with the reason the numbers moved"
        )
    problems = golden.differences(json.loads(GOLDEN.read_text()), got)
    assert not problems, (
        f"moved from {GOLDEN.name}:\n" + "\n".join(problems) + "\nif on purpose, rerun with "
        "DFLASH_WRITE_GOLDEN=1 and say why in the commit"
    )
    trained = got["measured"]["train_losses"]
    assert len(trained) == golden.STEPS and trained[-1] < trained[0]


def stored_states(store: Path) -> dict[str, np.ndarray]:
    group = zarr.open_group(str(store), mode="r")
    return {str(s): group[f"shards/{s:05d}/hidden"][:] for s in range(4)}


def summaries(states: dict[str, np.ndarray]) -> dict:
    return {s: golden.state_summary(bits) for s, bits in states.items()}


def test_states_a_few_rounding_steps_apart_hold(small_store):
    """Another CPU: 24 values of each shard one bf16 step up or down (more than any shard's most
    flipped tap in the spread measured), at random places."""
    rng = np.random.default_rng(0)
    states = stored_states(small_store)
    flipped = {s: bits.copy() for s, bits in states.items()}
    for bits in flipped.values():
        bits.reshape(-1)[rng.choice(bits.size, 24, replace=False)] ^= 1
    moved, where = golden.state_spread(summaries(states), summaries(flipped))
    assert 0 < moved <= golden.TOLERANCE["states"], where


CHANGES = {
    "taps shifted by one (each tap the layer before's output)": lambda bits: bits[:, [0, 0, 1, 2, 3]],
    "tokens shifted by one": lambda bits: np.roll(bits, 1, axis=0),
    "one token's states zeroed": lambda bits: np.where(np.arange(len(bits))[:, None, None] == 5, 0, bits),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_real_change_of_the_states_is_caught(small_store, change):
    states = stored_states(small_store)
    moved, where = golden.state_spread(summaries(states), summaries({s: CHANGES[change](b) for s, b in states.items()}))
    assert moved > 10 * golden.TOLERANCE["states"], where


def test_every_cpu_recorded_in_the_asset_holds_against_its_reference():
    """The asset's `also_measured` points (the figures an AVX-512 machine gave) lie within the
    tolerances of the reference: the test passes there too."""
    asset = json.loads(GOLDEN.read_text())
    assert asset["also_measured"], "the asset keeps no other CPU's figures"
    for point in asset["also_measured"]:
        assert point["cpu"]["capability"] != asset["cpu"]["capability"]
        assert golden.differences(asset, point) == [] and golden.differences(point, asset) == []


def test_a_difference_names_the_quantity_how_far_and_both_cpus():
    asset = json.loads(GOLDEN.read_text())
    other = {
        "capability": "DEFAULT",
        "processor": "elsewhere",
        "torch": asset["cpu"]["torch"],
        "env": {"ATEN_CPU_CAPABILITY": "default"},
    }
    losses = [x * (1 + 3 * golden.TOLERANCE["train_losses"]) for x in asset["measured"]["train_losses"]]
    got = {**asset, "cpu": other, "measured": {**asset["measured"], "train_losses": losses}}
    got["exact"] = {**asset["exact"], "tau_replay": asset["exact"]["tau_replay"] + 0.25}
    problems = golden.differences(asset, got)
    tau = asset["exact"]["tau_replay"]
    assert problems[0] == f"tau_replay: {tau} -> {tau + 0.25} (exact on every CPU measured)"
    moved = 3 * golden.TOLERANCE["train_losses"]
    assert problems[1].startswith(f"train_losses: {moved:.3g} relative, past the tolerance")
    assert problems[2] == (
        f"golden written on {golden.describe(asset['cpu'])}; this run on DEFAULT (elsewhere, torch "
        f"{asset['cpu']['torch']}, ATEN_CPU_CAPABILITY=default)"
    )


def test_a_rewrite_keeps_the_other_cpus_that_still_hold():
    asset = json.loads(GOLDEN.read_text())
    reference = {k: asset[k] for k in ("cpu", "exact", "measured", "hidden_crc32")}
    stale = {
        **reference,
        "cpu": {**reference["cpu"], "capability": "SSE42"},
        "measured": {**reference["measured"], "loss": 2 * reference["measured"]["loss"]},
    }
    same_cpu = {**reference, "measured": {**reference["measured"], "loss": 2 * reference["measured"]["loss"]}}
    new, dropped = golden.rewritten({**same_cpu, "also_measured": [*asset["also_measured"], stale]}, reference)
    assert new["also_measured"] == asset["also_measured"] and dropped == [golden.describe(stale["cpu"])]
