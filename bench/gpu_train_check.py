"""Stage-two GPU check (run by bench/gpu_check.sh on a CUDA machine; a measurement, not a test).

    python bench/gpu_train_check.py --store /tmp/fla.zarr --json bench/gpu/train.json

1. flex_attention (compiled, with the BlockMask) against the block-local SDPA path on one batch of
   real stored states: drafter output and parameter gradients, in fp32 and under bf16 autocast.
2. A short bf16 training run through stages.train.run (flex, fp32 master weights): steps/s,
   tokens/s, peak GPU memory, and that the loss went down. gpu_check.sh then evaluates the result
   with --live on CUDA (fla kernels in the target, rollback of their states).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.report import emit  # noqa: E402
from pipeline.drafter import masks  # noqa: E402
from pipeline.drafter.blocks import make_blocks, sample_anchors  # noqa: E402
from pipeline.drafter.loss import dflash_loss  # noqa: E402
from pipeline.drafter.model import Drafter  # noqa: E402
from stages.train.config import TrainConfig  # noqa: E402
from stages.train.data import StoreBatches, index_samples  # noqa: E402
from stages.train.run import run  # noqa: E402
from stages.train.setup import drafter_config  # noqa: E402
from stages.train.step import pad_for_compile  # noqa: E402
from store.hidden_store import HiddenStore  # noqa: E402


def kernel_agreement(store_path: str, anchors: int, dtype: str) -> dict:
    store = HiddenStore(store_path)
    config = TrainConfig(anchors=anchors, layer_types="sliding,sliding,sliding,sliding,full", sliding_window=64)
    dc, _ = drafter_config(config, store.attrs, None)
    dev = torch.device("cuda")
    model = Drafter(dc, store.embedding("embed_tokens").to(dev, torch.bfloat16),
                    store.embedding("lm_head").to(dev, torch.bfloat16)).to(dev)
    model.init_weights(torch.Generator().manual_seed(0), std=0.05)
    model.to(dev)
    refs = sorted(index_samples(store, sorted(store.committed())[:2], 1024), key=lambda r: -r.length)[:4]
    batch = StoreBatches(store_path, [[(r,) for r in refs]])[0].to(dev)
    a, v = sample_anchors(batch.loss_mask.cpu(), anchors, torch.Generator().manual_seed(0))
    a, v, S = pad_for_compile(a, v, int(a.max()), anchors)
    a, v = a.to(dev), v.to(dev)
    blk = make_blocks(batch.tokens, batch.loss_mask, a, v, dc.block_size, dc.mask_token_id)
    hidden = torch.nn.functional.pad(batch.hidden, (0, 0, 0, 0, 0, max(0, S - batch.hidden.shape[1])))[:, :S]
    pos = torch.arange(S, device=dev)[None].expand(len(refs), -1)
    out = {}
    for kind in ("local", "flex"):
        model.zero_grad()
        t = time.perf_counter()
        with torch.autocast("cuda", torch.bfloat16, enabled=dtype == "bf16"):
            mk = masks.build(model.rules, a, v, S, dc.block_size, kind)
            h = model(hidden, blk.block_ids, pos, blk.positions, mk)
        loss = dflash_loss(h, blk.labels, model.lm_head, 7.0).loss
        loss.backward()
        torch.cuda.synchronize()
        out[kind] = (h.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}, float(loss),
                     time.perf_counter() - t)
    (h0, g0, l0, t0), (h1, g1, l1, t1) = out["local"], out["flex"]
    rel = {n: float((g0[n] - g1[n]).norm() / g0[n].norm().clamp_min(1e-30)) for n in g0}
    return {"dtype": dtype, "anchors": anchors, "context": S, "loss_local": l0, "loss_flex": l1,
            "output_max_abs_diff": float((h0 - h1).abs().max()), "output_scale": float(h0.abs().max()),
            "grad_rel_diff_max": max(rel.values()), "grad_rel_diff_worst": max(rel, key=rel.get),
            "seconds_local_first": t0, "seconds_flex_first": t1}


def training(store_path: str, steps: int, batch_size: int, anchors: int, run_dir: str | None) -> dict:
    out = Path(run_dir) if run_dir else Path(tempfile.mkdtemp()) / "run"
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    summary = run(TrainConfig(store=store_path, out=str(out), max_steps=steps, batch_size=batch_size, anchors=anchors,
                              log_every=10), log=lambda m: print(m, file=sys.stderr))
    wall = time.perf_counter() - t
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["split"] == "train"]
    later = train[1:] or train
    return {"steps": summary["steps"], "wall_s": wall, "batch_size": batch_size, "anchors": anchors,
            "first_loss": train[0]["loss"], "last_loss": train[-1]["loss"],
            "tokens_per_s_median": sorted(r["tokens_per_s"] for r in later)[len(later) // 2],
            "peak_gpu_mem_gib": torch.cuda.max_memory_allocated() / 2**30}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--json", default=None)
    p.add_argument("--run-dir", default=None, help="where the training run goes (must not hold a run) [default: a temp dir]")
    args = p.parse_args()
    assert torch.cuda.is_available(), "this check needs CUDA"
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "kernels": [kernel_agreement(args.store, args.anchors, d) for d in ("fp32", "bf16")],
           "training": training(args.store, args.steps, args.batch_size, args.anchors, args.run_dir)}
    emit(res, args.json)


if __name__ == "__main__":
    main()
