"""Peak host memory while the target loads: the way extraction loads it (each tensor read
straight onto the device) against loading on the host and moving the model after.

    python bench/target_load_bench.py --device cpu --dtype bf16,fp32 [--json out.json]
    python bench/target_load_bench.py --device cuda --dtype bf16      # where the difference shows

A random-initialised target of the shipped architecture, widened to about 1.1 GB in bf16 (hidden
2048, vocab 32768, 8 layers), is saved once to a temporary directory; each load runs in a fresh
process that reports its peak RSS (ru_maxrss) and seconds. `straight` is pipeline.target.loading
.load; `host-then-move` is from_pretrained on the host then `.to(device)` (extraction before
2026-12-02). Safetensors are memory-mapped: a bf16 checkpoint loaded as bf16 on the host stays
file-backed (page cache, shared by the processes of a node), so RSS there is below the model's size.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "pipeline" / "assets" / "tiny_target"
WIDE = {"hidden_size": 2048, "intermediate_size": 6144, "vocab_size": 32768, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 128, "linear_num_key_heads": 8, "linear_num_value_heads": 16,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128}
CHILD = """
import resource, sys, time, torch
sys.path.insert(0, {root!r})
how, path, device, dtype = sys.argv[1:]
t = time.time()
if how == "straight":
    from pipeline.target.loading import load
    model = load(path, device, dtype, "torch").model
else:
    from transformers import AutoModelForCausalLM
    from pipeline.device import dtype as torch_dtype
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype)).to(device)
gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, gb, time.time() - t)  # ru_maxrss: KiB
"""


def make_target(where: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {**json.loads((TINY / "config.json").read_text()), **WIDE}
    (where / "config.json").write_text(json.dumps(config))
    for f in TINY.iterdir():
        if "token" in f.name or f.suffix == ".jinja":
            shutil.copy(f, where)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(where), dtype=torch.bfloat16).save_pretrained(where)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bf16,fp32", help="comma-separated: bf16, fp32")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        make_target(Path(tmp))
        for dtype in args.dtype.split(","):
            for how in ("host-then-move", "straight"):
                out = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT)), how, tmp, args.device, dtype],
                                     capture_output=True, text=True, check=True).stdout.split()
                rss_gb, model_gb, s = (float(x) for x in out[-3:])
                rows.append({"device": args.device, "dtype": dtype, "load": how, "peak_rss_gb": round(rss_gb, 3),
                             "model_gb": round(model_gb, 3), "s": round(s, 1)})
    print("| device | dtype | load | peak host RSS (GB) | model (GB) | s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['device']} | {r['dtype']} | {r['load']} | {r['peak_rss_gb']} | {r['model_gb']} | {r['s']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
