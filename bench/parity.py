"""Parity of hidden-state stores: two stores of the same token sequences compared per tap, and the fla
kernels against the PyTorch fallback on the shipped target's stored tokens.

    python -m bench.parity compare A.zarr B.zarr [--json out.json]

    tools/engines/build_fla_interpret.sh            # once: the venv with triton and fla
    VENV=~/.cache/dflash-pipeline/fla-interpret-venv
    $VENV/bin/python -m bench.parity fla extract --store /work/bench/bf16.zarr --shards 0-1 --out /work/bench/parity
    python -m bench.parity fla compare --out /work/bench/parity [--json bench/results/fla_parity_cpu.json]

`compare`: both stores must hold the same samples (make them with `--responses dataset`, so the
token sequences cannot differ). For each tap: mean and minimum per-token cosine similarity, max and
mean absolute difference, and the share of bf16 values that are bit-identical. bench/gpu_check.sh
runs it on a CUDA store of the fla kernels against one of the PyTorch fallback.

`fla extract` writes a torch-path store's prompts with its stored completions as token rows
(`--responses dataset` with response_ids, so nothing is generated through the slow interpreter) and
extracts --shards of them with the same settings as the store, on each of --paths: the torch path
and the fla path (fla's own kernel code under Triton's interpreter, TRITON_INTERPRET=1, with
tools/engines/fla_interpret's harness shims), in each of --dtypes. Runs over other shards may share
--out side by side (one process per core; the stores' shard locks keep them apart):

    $VENV/bin/python -m bench.parity fla extract ... --shards 0-31 --paths fla --dtypes fp32 &
    $VENV/bin/python -m bench.parity fla extract ... --shards 32-63 --paths fla --dtypes fp32

`fla compare` reads the four stores (any venv): per dtype, `compare`'s per-tap figures of the fla
store against the torch one, and each store's greedy agreement (the target's argmax against the
stored completion, recorded per shard by extraction), the backend that ran and its extraction time.

`fla packing` (run it in the fla-interpret venv under the interpreter for the fla path): whether the
target's kernels allow capture batches packed without padding. A few of the shipped prompts run
side by side in one row, with per-row positions and the varlen arguments transformers' kernels take
(`cu_seq_lens_q/k`, `max_length_q/k`), against each prompt alone; per tap the largest difference
on the first row, on the later rows' first positions (those the causal convolution reaches back
from) and after them, under each --attention implementation, with the implementations that served
the linear-attention calls:

    TRITON_INTERPRET=1 PYTHONPATH=tools/engines/fla_interpret:. $VENV/bin/python -m bench.parity fla packing \
        --path fla --json bench/results/packing_fla_cpu.json

--toy changes nothing: the toy runs are small stores (`fla extract --paths torch` needs no triton).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import harness

TOY = [
    ["compare", "{store}", "{fp8_store}"],
    [
        "fla",
        "extract",
        "--store",
        "{store}",
        "--out",
        "{tmp}/parity",
        "--shards",
        "0",
        "--paths",
        "torch",
        "--dtypes",
        "fp32",
    ],
    ["fla", "compare", "--out", "{tmp}/parity"],
    ["fla", "packing", "--path", "torch", "--rows", "2"],
]
SHIMS = harness.REPO / "tools" / "engines" / "fla_interpret"
PATHS = ("torch", "fla")
DTYPES = ("fp32", "bf16")


def per_tap(a, b) -> dict:
    """Per tap, how far store b's states are from store a's over the shards both committed."""
    import torch

    from store.shard_reader import ShardReader

    taps = a.attrs.taps
    if b.attrs.taps != taps:
        raise SystemExit(f"taps differ: {taps} vs {b.attrs.taps}")
    shards = sorted(set(a.committed()) & set(b.committed()))
    cos, maxabs, sumabs, same, count = [[] for _ in taps], [0.0] * len(taps), [0.0] * len(taps), [0] * len(taps), 0
    for shard in shards:
        for sa, sb in zip(ShardReader(a, shard), ShardReader(b, shard)):
            if not torch.equal(sa.tokens, sb.tokens):
                raise SystemExit(f"shard {shard} sample {sa.index}: token sequences differ; use --responses dataset")
            x, y = sa.hidden.float(), sb.hidden.float()  # [T, n_taps, H]
            count += len(x)
            for j in range(len(taps)):
                cos[j].append(torch.nn.functional.cosine_similarity(x[:, j], y[:, j], dim=-1))
                d = (x[:, j] - y[:, j]).abs()
                maxabs[j] = max(maxabs[j], d.max().item())
                sumabs[j] += d.sum().item()
                same[j] += (sa.hidden[:, j].view(torch.int16) == sb.hidden[:, j].view(torch.int16)).sum().item()
    hidden = a.attrs.hidden_size
    rows = []
    for j, k in enumerate(taps):
        c = torch.cat(cos[j])
        rows.append(
            {
                "tap": k,
                "cos_mean": c.mean().item(),
                "cos_min": c.min().item(),
                "max_abs": maxabs[j],
                "mean_abs": sumabs[j] / (count * hidden),
                "bit_identical": same[j] / (count * hidden),
            }
        )
    return {
        "a": a.location,
        "b": b.location,
        "a_backend": a.attrs.backends.linear_attention,
        "b_backend": b.attrs.backends.linear_attention,
        "shards": shards,
        "tokens": count,
        "taps": list(rows),
    }


def compare(args) -> dict:
    from store.hidden_store import HiddenStore

    return per_tap(HiddenStore(args.a), HiddenStore(args.b))


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
            rows[s.row_id]["response_ids"] = s.tokens[s.prompt_len :].tolist()
    path, text = out / "rows.jsonl", "".join(json.dumps(r) + "\n" for r in rows)
    if not path.exists() or path.read_text() != text:  # a run beside this one may be reading it
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path


def fla_extract(args) -> dict:
    from store.hidden_store import HiddenStore

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    attrs = (store := HiddenStore(args.store)).attrs
    data = rows_of(store, out)
    seconds = {}
    for dtype in args.dtypes.split(","):
        for path in args.paths.split(","):
            env = {**os.environ, "PYTHONPATH": f"{SHIMS}{os.pathsep}{harness.REPO}"}
            env.pop("TRITON_INTERPRET", None)
            if path == "fla":
                env["TRITON_INTERPRET"] = "1"
            cmd = [
                sys.executable,
                "-m",
                "pipeline",
                "extract",
                "--store",
                str(out / f"{path}-{dtype}.zarr"),
                "--dataset",
                str(data),
                "--shards",
                args.shards,
                "--num-shards",
                str(attrs.num_shards),
                "--responses",
                "dataset",
                "--linear-attention",
                path,
                "--dtype",
                dtype,
                "--device",
                "cpu",
                "--max-new-tokens",
                str(attrs.compat.max_new_tokens),
                "--max-length",
                str(attrs.compat.max_length),
                "--batch-size",
                str(args.batch_size),
            ]
            t0 = time.perf_counter()
            subprocess.run(cmd, env=env, check=True, cwd=harness.REPO)
            seconds[f"{path}-{dtype}"] = round(time.perf_counter() - t0, 1)
    return {"out": str(out), "shards": args.shards, "extract_s": seconds}


def fla_compare(args) -> dict:
    """Per dtype: the per-tap figures of the fla store against the torch one, and each store's record
    of what ran, its greedy agreement and its extraction time."""
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
                "linear_attention": s.attrs.backends.linear_attention,
                "triton": s.attrs.backends.triton,
                "kernel_calls": s.attrs.backends.kernel_calls,
                "greedy_agreement": matches / tokens,
                "agreement_tokens": tokens,
                "extract_s": round(sum(r.run.get("wall_s", 0) for r in records), 1),
            }
        result["per_dtype"][dtype] = per_tap(stores["fla"], stores["torch"])
    return result


def fla_packing(args) -> dict:
    """Rows packed into one forward (positions restarting per row, the varlen arguments given) against
    each row alone, per attention implementation and tap."""
    import torch

    from pipeline import DEFAULT_PROMPTS, TINY_TARGET
    from pipeline.target import loading

    target = loading.load(str(TINY_TARGET), "cpu", "fp32", args.path)
    lines = DEFAULT_PROMPTS.read_text().splitlines()[: args.rows]
    texts = [" ".join(m["content"] for m in json.loads(line)["messages"]) for line in lines]
    rows = [target.tokenizer(t, add_special_tokens=False).input_ids[: args.length] for t in texts]
    reach = target.model.config.linear_conv_kernel_dim - 1  # positions the convolution reaches back
    cu = torch.tensor([0, *itertools.accumulate(len(r) for r in rows)], dtype=torch.int32)
    packed = {
        "position_ids": torch.tensor([[i for r in rows for i in range(len(r))]]),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max(map(len, rows)),
        "max_length_k": max(map(len, rows)),
    }
    import transformers

    result = {
        "path": args.path,
        "transformers": transformers.__version__,
        "fla": importlib.metadata.version("flash-linear-attention") if args.path == "fla" else None,
        "row_lengths": [len(r) for r in rows],
        "conv_reach": reach,
        "attention": {},
    }
    with torch.no_grad(), target.recorder.recording():
        for attention in args.attention.split(","):
            target.model.set_attn_implementation(attention)
            alone = [states(target, r, {}) for r in rows]  # per row: [L+1, T, H]
            try:
                together = states(target, sum(rows, []), packed)  # [L+1, sum T, H]
            except ValueError as e:  # transformers' torch path refuses packed rows
                result["attention"][attention] = {"refused": str(e)}
                continue
            result["attention"][attention] = packing_errors(alone, together, cu, reach)
    result["linear_attention_calls"] = target.recorder.summary()["calls"]
    return result


def states(target, ids: list[int], extra: dict):
    import torch

    out = target.model(torch.tensor([ids]), output_hidden_states=True, **extra)
    return torch.stack(out.hidden_states)[:, 0]  # [L+1, T, H]


def packing_errors(alone: list, together, cu, reach: int) -> dict:
    """Per hidden_states index: the largest |packed - alone| on row 0, and on the later rows within and
    past `reach` positions of their start."""
    per_tap = {}
    for tap in range(together.shape[0]):
        diff = [(together[tap, cu[i] : cu[i + 1]] - a[tap]).abs().amax(-1) for i, a in enumerate(alone)]  # [T_i]
        later = diff[1:]
        per_tap[tap] = {
            "first_row": float(diff[0].max()),
            "later_rows_start": max(float(d[:reach].max()) for d in later),
            "later_rows_rest": max(float(d[reach:].max()) for d in later),
        }
    return per_tap


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    subs = p.add_subparsers(dest="cmd", required=True)
    c = harness.subcommand(subs, "compare", "per tap, store B's states against store A's")
    c.add_argument("a")
    c.add_argument("b")
    fla = subs.add_parser("fla", help="the fla kernels against the PyTorch fallback").add_subparsers(
        dest="step", required=True
    )
    e = harness.subcommand(fla, "extract", "the four stores (run in the fla-interpret venv)")
    e.add_argument("--store", required=True, help="a torch-path store whose prompts and completions to use")
    e.add_argument("--shards", default="0-1")
    e.add_argument("--out", required=True)
    e.add_argument("--batch-size", type=int, default=4)
    e.add_argument(
        "--paths",
        default=",".join(PATHS),
        help="which paths to extract, comma-separated; runs "
        "with other --shards may extract into the same stores side by side",
    )
    e.add_argument("--dtypes", default=",".join(DTYPES), help="of the target's forward, comma-separated")
    fc = harness.subcommand(fla, "compare", "per dtype and tap, the fla path against the torch path")
    fc.add_argument("--out", required=True)
    k = harness.subcommand(fla, "packing", "rows packed into one forward against each row alone")
    k.add_argument(
        "--path", choices=PATHS, default="fla", help="the linear-attention path (fla: under the interpreter)"
    )
    k.add_argument("--attention", default="sdpa,eager", help="attention implementations to try, comma-separated")
    k.add_argument("--rows", type=int, default=4, help="shipped prompts packed into the one row")
    k.add_argument("--length", type=int, default=96, help="tokens kept of each prompt")
    args = harness.parse(p)
    harness.torch_setup(args.threads)
    run = (
        compare
        if args.cmd == "compare"
        else {"extract": fla_extract, "compare": fla_compare, "packing": fla_packing}[args.step]
    )
    harness.emit(run(args), args)


if __name__ == "__main__":
    main()
