"""Peak memory of Target.capture against its token budget (--capture-tokens), on CPU (a measurement, not a test).

    python -m bench.capture_memory_bench [--json bench/results/capture_memory_cpu.json]

Two targets: the shipped tiny one (width 128, 8 layers) and a wider toy built from its config
(width 1024, 8 layers, random weights, fp32). For each, one set of rows of mixed lengths (many
short, a few long, one longer than the smaller budgets) is captured (5 taps, the forward stopped
after the last one) in a fresh process per setting:

  masked   the capture before --capture-tokens: every row in one forward, right-padded, with the
           attention mask (SDPA gets a [B, 1, W, W] mask)
  budget N the capture now: forwards of at most N positions, no mask, long rows chunked

Reported per setting: the process's peak resident set during the capture above what it held just
before (VmHWM, reset after loading and a warm-up), the host bytes of the states it returns (the same
for every setting), the largest forward (positions) and seconds. The difference between settings is
the forward's working memory: with a budget it follows the budget, not the rows.
--toy: the tiny target only, two settings, short rows.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from bench import harness

TOY = [[]]
TAPS = [1, 2, 3, 4, 5]
WIDE = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
}


def lengths(toy: bool) -> list[int]:
    """Rows of mixed lengths: many short, a few long, one long enough to be chunked."""
    if toy:
        return [40, 60, 90, 300]
    return [128] * 8 + [256] * 4 + [512] * 2 + [1024, 2048]


def wide_target(out: Path) -> Path:
    """The tiny target's directory with WIDE's shape and random (seeded) weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline import TINY_TARGET

    config = AutoConfig.from_pretrained(TINY_TARGET)
    for key, value in WIDE.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out)
    for f in TINY_TARGET.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(f, out / f.name)
    return out


def vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def masked_capture(target, seqs: list[list[int]]):
    """The capture as it was before --capture-tokens: one padded forward with the attention mask."""
    import torch

    from pipeline.target.taps import StopForward, tapping

    ids, mask = target._pad(seqs, left=False)
    grabbed: dict = {}
    try:
        with torch.inference_mode(), tapping(target.layers, TAPS, grabbed.__setitem__, stop_after_last=True):
            target.model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False)
    except StopForward:
        pass
    return torch.stack([grabbed[k] for k in TAPS], dim=2).to(torch.bfloat16)[mask.bool()]  # [T, n_taps, H]


def one(path: str, rows: list[int], budget: int | None, threads: int) -> dict:
    """In a fresh process: load, warm up, reset the peak, capture the rows once."""
    harness.torch_setup(threads)
    from pipeline.target import loading
    from pipeline.target.capture_batches import capture_batches, chunks

    target = loading.load(path, "cpu", "fp32", "auto")
    vocab = target.vocab_size
    seqs = [[(7 * i + 13 * j) % (vocab - 10) + 5 for j in range(n)] for i, n in enumerate(rows)]
    target.capture([seqs[0][:16]], TAPS, budget=64)  # warm-up: first-call allocations out of the peak
    Path("/proc/self/clear_refs").write_text("5")
    start, t = vm_hwm(), time.perf_counter()
    hidden = masked_capture(target, seqs) if budget is None else target.capture(seqs, TAPS, budget=budget)
    seconds, peak = time.perf_counter() - t, vm_hwm()
    forwards = (
        [len(rows) * max(rows)]
        if budget is None
        else [len(b.rows) * (hi - lo) for b in capture_batches(rows, budget) for lo, hi in chunks(b.width, budget)]
    )
    return {
        "setting": "masked" if budget is None else f"budget {budget}",
        "capture_tokens": budget,
        "peak_above_start_bytes": peak - start,
        "states_bytes": hidden.numel() * hidden.element_size(),
        "largest_forward_positions": max(forwards),
        "forwards": len(forwards),
        "seconds": round(seconds, 3),
    }


def measure(name: str, path: str, rows: list[int], budgets: list, threads: int) -> dict:
    runs = [harness.in_child(one, path, rows, b, threads)[0] for b in budgets]
    for r in runs:
        r["peak_above_start_mb"] = round(r["peak_above_start_bytes"] / 2**20, 1)
    return {"target": name, "rows": len(rows), "tokens": sum(rows), "longest": max(rows), "runs": runs}


def main(argv: list[str] | None = None) -> None:
    args = harness.parse(harness.parser(__doc__), argv)
    from pipeline import TINY_TARGET

    rows = lengths(args.toy)
    result = {"bench": "capture_memory", "taps": TAPS, "threads": args.threads, "targets": []}
    if args.toy:
        result["targets"].append(measure("tiny", str(TINY_TARGET), rows, [None, 128], args.threads))
        harness.emit(result, args)
        return
    budgets = [None, 8192, 2048, 512]
    result["targets"].append(measure("tiny (width 128)", str(TINY_TARGET), rows, budgets, args.threads))
    with tempfile.TemporaryDirectory() as tmp:
        path = str(wide_target(Path(tmp)))
        result["targets"].append(measure("wide toy (width 1024)", path, rows, budgets, args.threads))
    harness.emit(result, args)


if __name__ == "__main__":
    main()
