"""Parity of the fla kernels against the PyTorch fallback, on the shipped target's stored tokens.

    tools/engines/build_fla_interpret.sh            # once: the venv with triton and fla
    VENV=~/.cache/dflash-pipeline/fla-interpret-venv
    $VENV/bin/python bench/fla_parity.py extract --store /work/bench/bf16.zarr --shards 0-1 --out /work/bench/parity
    python bench/fla_parity.py compare --out /work/bench/parity --json bench/results/fla_parity_cpu.json

`extract` writes a torch-path store's prompts with its stored completions as token rows
(`--responses dataset` with response_ids, so nothing is generated through the slow interpreter) and
extracts --shards of them with the same settings as the store, on each of --paths: the torch path
and the fla path (fla's own kernel code under Triton's interpreter, TRITON_INTERPRET=1, with
tools/engines/fla_interpret's harness shims), in each of --dtypes. Runs over other shards may share
--out side by side (one process per core; the stores' shard locks keep them apart):

    $VENV/bin/python bench/fla_parity.py extract ... --shards 0-31 --paths fla --dtypes fp32 &
    $VENV/bin/python bench/fla_parity.py extract ... --shards 32-63 --paths fla --dtypes fp32 `compare` reads the four
stores (any venv): per dtype and tap, the max absolute difference of the stored bf16 states, their
cosine and the share of bit-identical values between the paths (bench/compare_stores.py), and each store's greedy
agreement (the target's argmax against the stored completion, recorded per shard by extraction).
On a GPU (bench/gpu_check.sh) the same comparison runs with the compiled kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHIMS = ROOT / "tools" / "engines" / "fla_interpret"
PATHS = ("torch", "fla")
DTYPES = ("fp32", "bf16")


def rows_of(store, out: Path) -> Path:
    """The store's prompts with the stored completions of every committed shard as response_ids
    (other rows kept with an empty one: extraction counts them as missing and skips them). The same
    file whatever --shards, so extractions of different shards into one store agree on its dataset."""
    from store.shard_reader import ShardReader

    source = Path(store.attrs.dataset.source)
    assert source.suffix == ".jsonl", f"{source}: this bench reads .jsonl prompt sets"
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    for shard in sorted(store.committed()):
        reader = ShardReader(store, shard)
        for i in range(len(reader)):
            s = reader[i]
            rows[s.row_id]["response_ids"] = s.tokens[s.prompt_len:].tolist()
    path, text = out / "rows.jsonl", "".join(json.dumps(r) + "\n" for r in rows)
    if not path.exists() or path.read_text() != text:  # a run beside this one may be reading it
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path


def extract(args) -> None:
    from store.hidden_store import HiddenStore

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = HiddenStore(args.store)
    attrs = store.attrs
    data = rows_of(store, out)
    for dtype in args.dtypes.split(","):
        for path in args.paths.split(","):
            env = {**os.environ, "PYTHONPATH": f"{SHIMS}{os.pathsep}{ROOT}"}
            env.pop("TRITON_INTERPRET", None)
            if path == "fla":
                env["TRITON_INTERPRET"] = "1"
            cmd = [sys.executable, "-m", "pipeline", "extract", "--store", str(out / f"{path}-{dtype}.zarr"),
                   "--dataset", str(data), "--shards", args.shards, "--num-shards", str(attrs.num_shards),
                   "--responses", "dataset", "--linear-attention", path, "--dtype", dtype, "--device", "cpu",
                   "--max-new-tokens", str(attrs.compat.max_new_tokens), "--max-length", str(attrs.compat.max_length),
                   "--batch-size", str(args.batch_size)]
            t0 = time.time()
            subprocess.run(cmd, env=env, check=True, cwd=ROOT)
            print(f"{path} {dtype}: {time.time() - t0:.0f} s", file=sys.stderr)


def compare(args) -> dict:
    """Per dtype: bench/compare_stores.py's per-tap figures of the fla store against the torch one,
    and each store's record of what ran, its greedy agreement and its extraction time."""
    from bench.compare_stores import compare as per_tap
    from store.hidden_store import HiddenStore

    out = Path(args.out)
    result = {"stores": {}, "per_dtype": {}}
    for dtype in DTYPES:
        if not (out / f"fla-{dtype}.zarr").exists():
            continue
        stores = {p: HiddenStore(str(out / f"{p}-{dtype}.zarr")) for p in PATHS}
        for p, s in stores.items():
            records = s.committed().values()
            matches, tokens = (sum(r.agreement[k] for r in records) for k in ("matches", "tokens"))
            result["stores"][f"{p}-{dtype}"] = {
                "linear_attention": s.attrs.backends.linear_attention, "triton": s.attrs.backends.triton,
                "kernel_calls": s.attrs.backends.kernel_calls, "greedy_agreement": matches / tokens,
                "agreement_tokens": tokens, "extract_s": round(sum(r.run.get("wall_s", 0) for r in records), 1)}
        result["per_dtype"][dtype] = per_tap(stores["fla"], stores["torch"])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("extract", help="the four stores (run in the fla-interpret venv)")
    e.add_argument("--store", required=True, help="a torch-path store whose prompts and completions to use")
    e.add_argument("--shards", default="0-1")
    e.add_argument("--out", required=True)
    e.add_argument("--batch-size", type=int, default=4)
    e.add_argument("--paths", default=",".join(PATHS), help="which paths to extract, comma-separated; runs "
                   "with other --shards may extract into the same stores side by side")
    e.add_argument("--dtypes", default=",".join(DTYPES), help="of the target's forward, comma-separated")
    c = sub.add_parser("compare", help="per dtype and tap, the fla path against the torch path")
    c.add_argument("--out", required=True)
    c.add_argument("--json")
    args = ap.parse_args()
    if args.cmd == "extract":
        extract(args)
        return
    from bench.report import emit

    emit(compare(args), args.json)


if __name__ == "__main__":
    main()
