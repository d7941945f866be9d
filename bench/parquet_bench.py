"""Extraction's reads of a Parquet dataset: rows decoded and seconds for one shard's rows, taken as
the extractor takes them (parsed, then ordered by prompt length), before and after 2026-12-04 (a
measurement, not a test).

    python bench/parquet_bench.py --rows 262144 --shard-rows 1024 --prompt-chars 800 [--json out.json]

Writes a file of --rows rows in ONE row group (pyarrow's default groups hold up to 1,048,576 rows),
prompts of 1 to 2 x --prompt-chars characters in no order, and times the shard in the middle, in a
fresh reader each way: `before` parses the rows in length order (each step back restarts the
stream at its row group), `after` is `PromptSet.by_length` (one forward pass, sorted in memory).
Rows decoded are counted at pyarrow's batch iterator.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from pipeline import prompts  # noqa: E402

DECODED: list[int] = []
_REAL = pq.ParquetFile.iter_batches


def _counting(self, *a, **k):
    for batch in _REAL(self, *a, **k):
        DECODED.append(batch.num_rows)
        yield batch


def one(path: Path, shard: int, shards: int, how: str) -> dict:
    ps = prompts.load(str(path))
    DECODED.clear()
    t = time.perf_counter()
    ids = ps.shard_rows(shard, shards)
    if how == "before":
        rows = [ps.row(i) for i in sorted(ids, key=lambda i: prompts.prompt_size(ps.row(i)))]
    else:
        rows = ps.by_length(ids)
    return {"rows": len(rows), "rows_decoded": sum(DECODED), "s": round(time.perf_counter() - t, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=262_144)
    p.add_argument("--shard-rows", type=int, default=1024)
    p.add_argument("--prompt-chars", type=int, default=800)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    pq.ParquetFile.iter_batches = _counting
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.parquet"
        texts = ["w" * rng.randrange(args.prompt_chars, 2 * args.prompt_chars) for _ in range(args.rows)]
        pq.write_table(pa.table({"prompt": texts, "response": ["r"] * args.rows}), path, row_group_size=args.rows)
        shards = args.rows // args.shard_rows
        out = {"args": vars(args) | {"json": str(args.json)}, "shard": shards // 2, "shards": shards,
               **{how: one(path, shards // 2, shards, how) for how in ("after", "before")}}
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
