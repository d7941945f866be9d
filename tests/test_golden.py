"""Golden numbers: what the tiny target's store holds and what 20 training steps on it give, checked
exactly against tests/data/golden_tiny_run.json, so that a change meant to keep behaviour (a
refactor, a dependency bump) is shown to keep it, and a change that moves a number is a reviewed
change of the asset.

The numbers: every array's CRC-32 in each shard's commit record (extraction: tokens, loss masks,
states, per-sample arrays), the 20 training losses of train.py's defaults in the TINY setting, and the
final held-out loss, streak tau and replayed chain tau. CPU, one thread, the torch README pins.

When a change moves them on purpose, rewrite the asset and say why in the commit:

    DFLASH_WRITE_GOLDEN=1 pytest tests/test_golden.py
"""

import json
import os
from pathlib import Path

import pytest

from tests.processes import TINY, losses, train

GOLDEN = Path(__file__).parent / "data" / "golden_tiny_run.json"


def measure(store: Path, out: Path) -> dict:
    from store.hidden_store import HiddenStore

    records = HiddenStore(str(store)).committed()
    r = train(["--store", store, "--out", out, "--shards", "0-2", "--eval-shards", "3", "--max-steps", 20,
               "--save-every", 0, *TINY])
    assert r.returncode == 0, r.stderr[-3000:]
    final = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["split"] == "eval" and final["step"] == 20
    return {"checksums": {str(s): rec.checksums for s, rec in records.items()},
            "train_losses": losses(out),
            "final_eval": {k: final[k] for k in ("loss", "tau_streak", "tau_replay", "replay_prompts")}}


def test_the_golden_numbers_hold(small_store, tmp_path):
    got = measure(small_store, tmp_path / "run")
    if os.environ.get("DFLASH_WRITE_GOLDEN"):
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"wrote {GOLDEN}: commit it with the reason the numbers moved")
    want = json.loads(GOLDEN.read_text())
    moved = [k for k in want if got.get(k) != want[k]]
    assert not moved, (f"{', '.join(moved)} moved from {GOLDEN.name}: if on purpose, rerun with DFLASH_WRITE_GOLDEN=1 "
                       f"and say why in the commit\nwant: {[want[k] for k in moved]}\ngot:  {[got.get(k) for k in moved]}")
    assert len(got["train_losses"]) == 20 and got["train_losses"][-1] < got["train_losses"][0]
