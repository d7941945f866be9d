"""The tiny target's larger held-out prompt sets: an evaluation set and a training pool.

    python tools/heldout_prompts.py --out-dir pipeline/assets

writes, next to the shipped pipeline/assets/prompts.jsonl (640 prompts, left as it is):

- heldout_eval.jsonl (264 prompts): held-out functions for evaluation only, disjoint from every
  training set below; sorted by name, as prompts.jsonl.
- heldout_pool.jsonl (1,060 prompts): the shipped 640 and 420 more held-out functions, in one
  seeded shuffle, so that the first n rows (the first shards of a store of it) are a random sample
  of n and every smaller training set is inside every larger one. 106 shards of 10 rows.

Made as the shipped set is (train_tiny_target.py's held-out functions that fit: header <= 160
tokens, body <= 256), from the functions the shipped set did not take, leaving out any whose name
is a shipped prompt's, and any whose body (the answer) is the body of a function the target trained
on, of a shipped prompt or of another function kept: every answer here is one the target never saw
and appears once. Seeded: the same files, byte for byte, on the Python version the target's corpus
was read from (its provenance.json); another version's standard library gives other functions, so
the tool refuses to run on one.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import stdlib_corpus  # noqa: E402
import train_tiny_target  # noqa: E402  (pins the CPU Gated DeltaNet path, as for training)

ASSETS = Path(__file__).resolve().parents[1] / "pipeline" / "assets"
EVAL_PROMPTS = 264  # >= 245, what a 2% chain-tau difference needs per seed (docs/training.md)
SHARD_ROWS = 10  # rows a shard of the pool: --num-shards = rows / 10 gives shards of equal size


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, required=True, help="where heldout_eval.jsonl and heldout_pool.jsonl go")
    p.add_argument(
        "--target", type=Path, default=ASSETS / "tiny_target", help="the tiny target (tokenizer, provenance)"
    )
    p.add_argument("--shipped", type=Path, default=ASSETS / "prompts.jsonl", help="the shipped prompt set")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def check_python(target: Path) -> None:
    made = json.loads((target / "provenance.json").read_text())["python"]
    if platform.python_version() != made:
        raise SystemExit(
            f"error: {target}/provenance.json: the corpus was read from Python {made}'s standard "
            f"library, this is Python {platform.python_version()}: its functions differ, so would these "
            f"sets (run it with Python {made})"
        )


def new_functions(functions: list[stdlib_corpus.Function], tok, shipped: list[dict]) -> list[stdlib_corpus.Function]:
    """Held-out functions that fit, not shipped, each answer new: sorted by name."""
    names = {r["id"] for r in shipped}
    seen = {f.body for f in functions if not f.heldout} | {r["messages"][1]["content"] for r in shipped}
    out = []
    fit = train_tiny_target.fitting([f for f in functions if f.heldout], tok)
    for f in sorted(fit, key=lambda f: (f.name, f.header, f.body)):
        if f.name in names or f.body in seen:
            continue
        names.add(f.name)
        seen.add(f.body)
        out.append(f)
    return out


def split(new: list[stdlib_corpus.Function], shipped: list[dict], seed: int) -> tuple[list[dict], list[dict]]:
    """-> (evaluation rows sorted by name, pool rows: shipped + the rest of new, shuffled)."""
    rng = random.Random(seed)
    order = list(new)
    rng.shuffle(order)
    rest = len(order) - EVAL_PROMPTS
    rest -= (len(shipped) + rest) % SHARD_ROWS  # the pool in whole shards; the remainder evaluates
    pool_new, evaluation = order[:rest], order[rest:]
    row = lambda f: {"id": f.name, "messages": f.messages()}  # noqa: E731
    pool = shipped + [row(f) for f in pool_new]
    rng.shuffle(pool)
    return [row(f) for f in sorted(evaluation, key=lambda f: f.name)], pool


def write(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    args = parse_args()
    check_python(args.target)
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(args.target)
    shipped = [json.loads(x) for x in args.shipped.read_text().splitlines() if x]
    evaluation, pool = split(new_functions(stdlib_corpus.collect(), tok, shipped), shipped, args.seed)
    write(evaluation, args.out_dir / "heldout_eval.jsonl")
    write(pool, args.out_dir / "heldout_pool.jsonl")
    print(
        f"{len(evaluation)} prompts -> {args.out_dir / 'heldout_eval.jsonl'}; {len(pool)} prompts "
        f"({len(shipped)} shipped) -> {args.out_dir / 'heldout_pool.jsonl'}"
    )


if __name__ == "__main__":
    main()
