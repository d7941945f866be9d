"""Host memory of building the drafter with the target's frozen embed_tokens and lm_head, the way
training did before and does now (a measurement, not a test).

    python bench/frozen_bench.py --vocab 248320 --hidden 1024

Each case runs in a fresh subprocess and reports its peak resident memory (ru_maxrss) above what it
held before the first read. The store is replaced by a stand-in whose `embedding(name)` returns
what HiddenStore.embedding returns: a bf16 tensor over a freshly read uint16 array (every page
written, as a read writes them), so only the store's decoding buffers are left out.

Cases (V x H each tensor; the drafter itself has one layer, so its parameters add little):
  fp32 before / after  CPU training. Before: both reads held by prepare(), `.to(float32)` of each
                       (both alive, as call arguments) and the Drafter's `.clone()` of each.
                       After: stages.train.setup.frozen_tensors (each read converted to fp32, then
                       dropped) and a Drafter that keeps what it is given.
  bf16 before / after  The host side of GPU training (kept bf16), on the host. Before: both reads
                       and both clones. After: the two reads, which the Drafter keeps. On a GPU,
                       frozen_tensors moves each read to the device and drops it before the next,
                       so there the host holds one read at a time.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = ("fp32 before", "fp32 after", "bf16 before", "bf16 after")


class SyntheticStore:
    """embedding(name) -> [V, H] bf16 over a new uint16 array, as HiddenStore.embedding returns it."""

    def __init__(self, vocab: int, hidden: int) -> None:
        self.shape = (vocab, hidden)

    def embedding(self, name: str):
        import numpy as np

        from store import layout

        bits = np.empty(self.shape, dtype=np.uint16)
        bits.fill(0x3F80)  # bf16 1.0; writes every page
        return layout.from_bits(bits)


def current_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def build(case: str, vocab: int, hidden: int):
    """The drafter the case builds (run in the child)."""
    import torch

    from pipeline.drafter.config import DrafterConfig
    from pipeline.drafter.model import Drafter
    from stages.train.setup import frozen_tensors

    dc = DrafterConfig(hidden_size=hidden, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=vocab, block_size=16, mask_token_id=vocab - 1,
                       target_layer_ids=(1,), num_target_layers=4, layer_types=("full_attention",))
    store = SyntheticStore(vocab, hidden)
    frozen = torch.float32 if case.startswith("fp32") else torch.bfloat16
    if case == "fp32 after":
        return Drafter(dc, *frozen_tensors(store, torch.device("cpu")))
    if case == "bf16 after":
        return Drafter(dc, store.embedding("embed_tokens"), store.embedding("lm_head"))
    embed, lm_head = store.embedding("embed_tokens"), store.embedding("lm_head")  # held by prepare()
    args = embed.to(frozen), lm_head.to(frozen)  # build_model's arguments, alive while the Drafter is made
    model = Drafter(dc, *(w.detach().clone() for w in args))  # the previous Drafter stored a clone of each
    del args
    model.held = (embed, lm_head)  # prepare() kept its reads until it returned
    return model


def child(case: str, vocab: int, hidden: int) -> None:
    import torch  # noqa: F401  (imported before the baseline)

    import pipeline.drafter.model  # noqa: F401
    import stages.train.setup  # noqa: F401

    base = current_mib()
    model = build(case, vocab, hidden)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"baseline_mib": round(base, 1), "peak_mib": round(peak, 1), "added_mib": round(peak - base, 1),
                      "held_at_end_mib": round(current_mib() - base, 1),
                      "buffer_dtype": str(model.embed_tokens.dtype)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=248_320)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--json", default=None, help="write the result here (the committed one: bench/results/frozen_cpu.json); "
                    "without it the result is printed only")
    ap.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.vocab, args.hidden)
    one_bf16 = args.vocab * args.hidden * 2 / 2**20
    results = {}
    for case in CASES:
        out = subprocess.run([sys.executable, __file__, "--child", case, "--vocab", str(args.vocab), "--hidden",
                              str(args.hidden)], check=True, capture_output=True, text=True).stdout
        results[case] = json.loads(out.splitlines()[-1])
        print(f"{case}: +{results[case]['added_mib']:.0f} MiB peak ({results[case]['added_mib'] / one_bf16:.2f} "
              f"bf16 [V, H] tensors), +{results[case]['held_at_end_mib']:.0f} MiB held after", flush=True)
    record = {"command": "python bench/frozen_bench.py " + " ".join(sys.argv[1:]),
              "args": {"vocab": args.vocab, "hidden": args.hidden},
              "machine": {"python": platform.python_version(), "torch": __import__("torch").__version__},
              "one_bf16_tensor_mib": round(one_bf16, 1), "results": results}
    print(json.dumps(record, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
