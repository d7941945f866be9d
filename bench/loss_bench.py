"""The DFlash loss at the real vocabulary width on CPU: the previous chunked-checkpoint loss against
the fused linear + cross-entropy (a measurement, not a test).

    python bench/loss_bench.py --json bench/results/loss_cpu.json   # all variants
    python bench/loss_bench.py --rows 2048 --hidden 128 --repeat 2

V = 248,320 (Qwen3.6-27B's vocabulary) with a small hidden size and a few thousand labelled rows, so
it fits a small machine. Each variant runs in a fresh subprocess: its peak resident memory is
ru_maxrss after forward + backward minus ru_maxrss once the inputs exist (the loss's own peak, lm_head
and h not counted). Time: forward + backward, the fastest of --repeat. The variants:

- old: the previous `dflash_loss` (F.linear -> fp32 logits -> F.cross_entropy, chunks of 4096 rows,
  torch.utils.checkpoint only when the rows need more than one chunk), kept here as the baseline; at
  --rows <= 4096 it is one chunk and holds every row's logits, as it did for any sequence of up to
  4096 labelled rows;
- old-ckpt: the same with chunks of --rows / 2, so that its recomputing (checkpoint) path runs as it
  does past 4096 rows; its peak is that of one chunk (a 4096-row chunk at V = 248,320 would need
  about 12 GB here, more than this bench may take);
- new: `pipeline.drafter.loss.dflash_loss` (chunk rows from LOGITS_BYTES: 270 rows at this V).

The JSON also holds each variant's loss and gradient norm (they must agree) and the full-size
arithmetic for the 27B setting.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from pipeline.drafter.loss import LOGITS_BYTES, dflash_loss, rows_within, slot_weights  # noqa: E402

VOCAB = 248_320
B = 16
OLD_CHUNK = 4096


def old_loss(h, labels, head, gamma, chunk=OLD_CHUNK):
    """The loss as it was before the fused cross-entropy (weights and reduction the same)."""
    def ce_pred(hs, hd, ys):
        logits = F.linear(hs.to(hd.dtype), hd).float()
        return F.cross_entropy(logits, ys, reduction="none"), logits.argmax(-1)

    b, n, _ = labels.shape
    keep = labels != -100
    h_sel, y = h.reshape(b, n, B, -1)[keep], labels[keep]
    w = slot_weights(B, gamma)[None, None].expand(b, n, B)[keep]
    ce = []
    for lo in range(0, len(y), chunk):
        hs, ys = h_sel[lo:lo + chunk], y[lo:lo + chunk]
        if hs.requires_grad and len(y) > chunk:
            c, _ = checkpoint(ce_pred, hs, head, ys, use_reentrant=False)
        else:
            c, _ = ce_pred(hs, head, ys)
        ce.append(c)
    ce = torch.cat(ce)
    return (w * ce).sum() / w.sum()


def inputs(rows: int, hidden: int):
    """[b=1, N, B] labels with every draft slot labelled: N*15 >= rows labelled rows."""
    g = torch.Generator().manual_seed(0)
    n = -(-rows // (B - 1))
    head = torch.randn(VOCAB, hidden, generator=g) * hidden ** -0.5
    h = torch.randn(1, n * B, hidden, generator=g)
    labels = torch.randint(0, VOCAB, (1, n, B), generator=g)
    labels[..., 0] = -100
    labels.view(-1)[torch.nonzero(labels.view(-1) != -100).flatten()[rows:]] = -100  # exactly `rows` labels
    return h, labels, head


def one(variant: str, rows: int, hidden: int, repeat: int) -> dict:
    """Runs in the subprocess."""
    torch.manual_seed(0)
    h, labels, head = inputs(rows, hidden)
    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, loss, gnorm = [], None, None
    for _ in range(repeat):
        x = h.clone().requires_grad_()
        t0 = time.perf_counter()
        if variant == "new":
            out = dflash_loss(x, labels, head, 7.0).loss
        else:
            out = old_loss(x, labels, head, 7.0, OLD_CHUNK if variant == "old" else rows // 2)
        out.backward()
        times.append(time.perf_counter() - t0)
        loss, gnorm = float(out), float(x.grad.norm())
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"variant": variant, "rows": rows, "hidden": hidden, "vocab": VOCAB, "fwd_bwd_s": round(min(times), 3),
            "all_s": [round(t, 3) for t in times], "loss_peak_mib": round((peak_kb - base_kb) / 1024, 1),
            "process_peak_mib": round(peak_kb / 1024, 1), "loss": loss, "grad_norm": gnorm}


def full_size() -> dict:
    """Bytes of logits per chunk at Qwen3.6-27B scale (V 248,320; 512 anchors x 15 labelled slots)."""
    labelled = 512 * (B - 1)
    new_rows = rows_within(VOCAB)
    return {
        "vocab": VOCAB, "labelled_rows_per_sequence": labelled,
        "old_chunk_rows": OLD_CHUNK, "old_chunk_fp32_logits_bytes": OLD_CHUNK * VOCAB * 4,
        "old_chunk_bf16_logits_bytes": OLD_CHUNK * VOCAB * 2,
        "new_chunk_rows": new_rows, "new_chunk_fp32_logits_bytes": new_rows * VOCAB * 4,
        "new_chunk_bf16_logits_bytes": new_rows * VOCAB * 2, "LOGITS_BYTES": LOGITS_BYTES,
        "new_saved_between_fwd_bwd": "h [7680, 5120] bf16 (78.6 MB, as before) + logsumexp [7680] fp32",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2048, help="labelled rows (at most 4096: one old chunk)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the result here (the committed one: bench/results/loss_cpu.json); "
                    "without it the result is printed only")
    ap.add_argument("--one", nargs=2, metavar=("VARIANT", "ROWS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], int(a.one[1]), a.hidden, a.repeat)))
        return
    results = []
    for variant in ("old", "old-ckpt", "new"):
        cmd = [sys.executable, __file__, "--one", variant, str(a.rows), "--hidden", str(a.hidden),
               "--repeat", str(a.repeat)]
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        print(json.dumps(r), flush=True)
        results.append(r)
    doc = {"command": "python " + " ".join(sys.argv), "machine": {"cpus": torch.get_num_threads(),
           "python": platform.python_version(), "torch": torch.__version__}, "results": results,
           "full_size": full_size()}
    print(json.dumps(doc, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
