"""recipe_results.table: paired differences only between runs of the same world size."""

import json
import math

from recipe_results import table


def keep(results, name: str, seed: int, tau: float, processes: int | None) -> None:
    """A kept run of the recipe bench with chain tau `tau` (processes None: a file from before the field)."""
    run = {
        "recipe": name,
        "seed": seed,
        "flags": {},
        "train_store": "/work/bench/hs.zarr",
        "blocks_per_step": 256.0,
        "tau": tau,
        "prompts": [{"tau": tau, "eos": True}, {"tau": tau, "eos": False}],
    }
    if processes is not None:
        run["processes"] = processes
    d = results / "200" / name
    d.mkdir(parents=True, exist_ok=True)
    (d / f"s{seed}.json").write_text(json.dumps(run))


def test_runs_of_another_world_size_are_never_paired(tmp_path):
    for seed in (0, 1, 2):
        keep(tmp_path, "default", seed, 6.0 + seed, None)  # one process, kept before `processes` was recorded
        keep(tmp_path, "default@p2", seed, 5.0 + seed, 2)
        keep(tmp_path, "grad-bf16@p2", seed, 5.1 + seed + 0.1 * seed, 2)
        keep(tmp_path, "accept-0.5", seed, 6.5 + seed, 1)
    one = table(tmp_path, 200, "default")["recipes"]
    assert one["default"]["processes"] == [1] and one["grad-bf16@p2"]["processes"] == [2]
    assert "paired" not in one["grad-bf16@p2"]["tau"] and "paired" not in one["default@p2"]["tau"]
    assert math.isclose(one["accept-0.5"]["tau"]["paired"]["diff"], 0.5)
    two = table(tmp_path, 200, "default@p2", ["grad-bf16@p2"])["recipes"]
    assert sorted(two) == ["default@p2", "grad-bf16@p2"]
    paired = two["grad-bf16@p2"]["tau"]["paired"]
    assert paired["seeds"] == [0, 1, 2] and math.isclose(paired["diff"], 0.2)  # 0.1, 0.2, 0.3
    low, high = paired["ci95"]
    assert low < 0.2 < high and math.isclose(high - 0.2, 4.303 * 0.1 / math.sqrt(3))
