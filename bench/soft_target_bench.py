"""Soft targets, measured before they are built: does training toward the target's own next-token
distribution beat hard labels on the recipe bench? A prototype in bench code only.

    python bench/soft_target_bench.py states --store S --out /work/bench/final_states.pt
    python bench/soft_target_bench.py train --states /work/bench/final_states.pt --beta 0.5 -- <train.py flags>

`states` runs the store's target (its recorded path; the PyTorch kernels, bf16, as the bench store
was extracted) once over every stored sample, one sample a forward, and keeps the decoder's output
after the final norm (`last_hidden_state`, transformers' last `hidden_states` entry) per sample,
[T, H] bf16. It checks what a store option would have to: the stored tap states are reproduced
(max |difference| over all taps reported), and the argmax of the stored lm_head applied to the
final state at position t equals the stored token t+1 on the completions (the agreement that
extraction recorded, 99.87% on the bench store).

`train` runs train.py in this process with the loss replaced: for every labelled slot k of the
block at anchor a, the target's distribution is softmax(lm_head(final[a + k - 1])) (the target
predicts token a+k at position a+k-1), and the loss is
    sum_k w_k (beta KL(p_target || p_drafter) + (1 - beta) CE(token[a+k])) / sum_k w_k
with the run's slot weights (beta 1: pure KL). Everything else (anchors, masks, statistics, the
held-out CE and streaks, which stay hard-label figures) is train.py's own. What it patches, and
only for this process and its loader workers: StoreBatches (each batch also carries the final
states of its rows), Batch.to (keeps them), and stages.train.step's make_blocks and dflash_loss.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pipeline.drafter import loss as L  # noqa: E402
from pipeline.drafter.blocks import IGNORE  # noqa: E402


def states(store_path: str, out: str) -> None:
    from pipeline.target.loading import load
    from pipeline.target.taps import tapping
    from store.hidden_store import HiddenStore
    from store.shard_reader import ShardReader

    store = HiddenStore(store_path)
    attrs = store.attrs
    target = load(attrs.target.path, "cpu", "bf16", "torch")
    head = store.embedding("lm_head").float()
    finals, worst, agree, total = {}, 0.0, 0, 0
    decoder = target.model.get_decoder()
    with torch.inference_mode():
        for shard in sorted(store.committed()):
            reader = ShardReader(store, shard)
            for i in range(len(reader)):
                s = reader[i]
                grabbed = {}
                with tapping(target.layers, list(attrs.taps), grabbed):
                    res = decoder(input_ids=s.tokens[None], use_cache=False)
                taps = torch.stack([grabbed[k][0] for k in attrs.taps], 1).to(torch.bfloat16)  # [T, n_taps, H]
                worst = max(worst, float((taps.float() - s.hidden.float()).abs().max()))
                final = res.last_hidden_state[0].to(torch.bfloat16)  # [T, H]
                finals[(shard, i)] = final.clone()
                P, T = s.prompt_len, len(s.tokens)
                pred = (final[P - 1:T - 1].float() @ head.T).argmax(-1)
                agree += int((pred == s.tokens[P:T]).sum())
                total += T - P
    torch.save(finals, out)
    print(f"{len(finals)} samples; stored taps reproduced to max |diff| {worst:.3g}; argmax of lm_head(final) "
          f"equals the stored completion token on {agree}/{total} = {100 * agree / total:.2f}%")


class Patch:
    def __init__(self, finals: dict, beta: float) -> None:
        self.finals, self.beta, self.batch, self.blocks = finals, beta, None, None

    def install(self) -> None:
        import stages.train.data as D
        import stages.train.step as S

        get, to, fwd, make = D.StoreBatches.__getitem__, D.Batch.to, S.forward_loss, S.make_blocks
        patch = self

        def getitem(ds, i):
            b = get(ds, i)
            final = torch.zeros(*b.tokens.shape, b.hidden.shape[-1], dtype=torch.bfloat16)
            for j, row in enumerate(ds.batches[i]):
                at = 0
                for r in row:
                    final[j, at:at + r.length] = patch.finals[(r.shard, r.index)][:r.length]
                    at += r.length
            b.final = final
            return b

        def moved(b, device):
            out = to(b, device)
            out.final = b.final.to(device)
            return out

        def forward(model, raw, batch, plan, gen):
            patch.batch = batch
            return fwd(model, raw, batch, plan, gen)

        def blocks(*a, **k):
            patch.blocks = make(*a, **k)
            return patch.blocks

        D.StoreBatches.__getitem__, D.Batch.to, S.forward_loss, S.make_blocks = getitem, moved, forward, blocks
        S.dflash_loss = self.loss

    def loss(self, h, labels, lm_head, gamma, dpace=None, chunk_rows=None, norm="weights"):
        b, n, B = labels.shape
        keep = labels != IGNORE
        h_sel, y = h.reshape(b, n, B, -1)[keep], labels[keep]  # [M, H], [M]
        ce, pred = L.linear_cross_entropy(h_sel, lm_head, y, chunk_rows)
        w = L._weights(ce, keep, gamma, dpace)
        pos = (self.blocks.anchors[..., None] + torch.arange(B, device=labels.device) - 1).clamp(min=0)  # [b, N, B]
        row = torch.arange(b, device=labels.device)[:, None, None].expand_as(pos)
        target = self.batch.final[row[keep], pos[keep]]  # [M, H] bf16: the target's state before each label
        logp_t = F.log_softmax(F.linear(target.to(lm_head.dtype), lm_head).float(), -1)
        logp_d = F.log_softmax(F.linear(h_sel.to(lm_head.dtype), lm_head).float(), -1)
        kl = (logp_t.exp() * (logp_t - logp_d)).sum(-1)  # [M]
        per = self.beta * kl + (1 - self.beta) * ce
        denom = w.sum() if norm == "weights" else w.new_tensor(float(len(w)))
        loss = (w * per).sum() / denom.clamp_min(1e-12)
        correct = torch.zeros(b, n, B, dtype=torch.bool, device=h.device)
        correct[keep] = pred == y
        return L.LossOut(loss, L._sums(ce.detach(), w, correct, keep))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("states")
    s.add_argument("--store", required=True)
    s.add_argument("--out", required=True)
    t = sub.add_parser("train")
    t.add_argument("--states", required=True)
    t.add_argument("--beta", type=float, default=0.5)
    t.add_argument("flags", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.cmd == "states":
        return states(args.store, args.out)
    Patch(torch.load(args.states), args.beta).install()
    import train

    sys.argv = ["train.py", *[f for f in args.flags if f != "--"]]
    from stages.command import run_command
    from stages.train.run import INTERRUPTED

    run_command(train.main, INTERRUPTED)


if __name__ == "__main__":
    main()
