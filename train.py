"""Stage two: train a DFlash drafter purely from a hidden-state store.

    accelerate launch train.py --store hs.zarr --out runs/NAME [--eval-shards 60-63] ...

Parses flags into a TrainConfig and calls stages.train.run; errors are one line.
"""

from __future__ import annotations

import os

import click

HELP = """Train a DFlash drafter from the --store (written by `pipeline extract`); no target model is loaded.

\b
Single process:   python train.py --store hs.zarr --out runs/a --eval-shards 60-63
8 GPUs:           accelerate launch --multi_gpu --num_processes 8 train.py --store hs.zarr ...
2 CPU processes:  accelerate launch --multi_gpu --num_processes 2 train.py ... (real DDP on CPU)

Writes OUT/metrics.jsonl, OUT/step-N/ every --save-every steps (a drafter checkpoint in the
public DFlash layout plus the training state) and OUT/final/. --resume continues a stopped run
exactly (same flags, same number of processes).
"""


@click.command(help=HELP, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--store", default="hs.zarr", show_default=True, help="Hidden-state store (path or fsspec URL).")
@click.option("--out", default="runs/drafter", show_default=True, help="Run directory.")
@click.option("--shards", default=None, help="Training shards, e.g. '0-55'. [default: every committed shard not in --eval-shards]")
@click.option("--eval-shards", default=None, help="Held-out shards for validation, e.g. '56-63'. [default: none]")
@click.option("--max-steps", type=int, default=None, help="Optimizer steps; overrides --epochs.")
@click.option("--epochs", type=int, default=6, show_default=True, help="Passes over the training samples.")
@click.option("--lr", type=float, default=6e-4, show_default=True, help="Peak AdamW learning rate.")
@click.option("--warmup-ratio", type=float, default=0.04, show_default=True, help="Linear warmup share of the steps; cosine decay after.")
@click.option("--grad-clip", type=float, default=1.0, show_default=True, help="Gradient norm clip (0: off).")
@click.option("--weight-decay", type=float, default=0.0, show_default=True, help="AdamW weight decay.")
@click.option("--block-size", type=int, default=16, show_default=True, help="Block size B: anchor token + B-1 drafts.")
@click.option("--gamma", type=float, default=None, help="Loss decay w_k = exp(-(k-1)/gamma). [default: 7 for B=16, 5 for 10, 4 for 8]")
@click.option("--anchors", type=int, default=512, show_default=True, help="Blocks per sequence, resampled every step.")
@click.option("--max-length", type=int, default=4096, show_default=True, help="Tokens per sample used (longer ones are cut).")
@click.option("--batch-size", type=int, default=1, show_default=True, help="Sequences per process per micro-batch.")
@click.option("--grad-accum", type=int, default=1, show_default=True, help="Micro-batches per optimizer step.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the initialization, data order and anchors.")
@click.option("--noise-std", type=float, default=0.0, show_default=True, help="Gaussian noise on fc's input only (never the labels).")
@click.option("--save-every", type=int, default=1000, show_default=True,
              help="Write OUT/step-N (what --resume continues from) every N steps, and at the end (0: only OUT/final).")
@click.option("--eval-every", type=int, default=0, show_default=True, help="Validate every N steps (always before the first step and at the end).")
@click.option("--log-every", type=int, default=10, show_default=True, help="Write a metrics record every N steps.")
@click.option("--workers", type=int, default=2, show_default=True, help="Data loader worker processes per training process.")
@click.option("--threads", type=int, default=None,
              help="CPU only: intra-op threads per process. [default: $OMP_NUM_THREADS, else cores / processes] "
                   "On a busy machine 1 can be much faster: OpenMP threads that wait on each other crawl.")
@click.option("--num-layers", type=int, default=None, help="Drafter layers. [default: 5]")
@click.option("--num-heads", type=int, default=None, help="Query heads. [default: from the store's hidden size]")
@click.option("--num-kv-heads", type=int, default=None, help="Key/value heads. [default: heads / 4]")
@click.option("--head-dim", type=int, default=None, help="Head dimension. [default: 128, or hidden/4 below 1024]")
@click.option("--intermediate-size", type=int, default=None, help="MLP width. [default: 3.4 x hidden, rounded to 64]")
@click.option("--layer-types", default=None,
              help="'full', 'sliding', or one per layer, e.g. 'sliding,sliding,sliding,sliding,full'. "
                   "[default: --drafter-config's, else full]")
@click.option("--sliding-window", type=int, default=None, help="Window of sliding layers (positions).")
@click.option("--rope-theta", type=float, default=None, help="RoPE base. [default: --drafter-config's, else 1e6]")
@click.option("--mask-token-id", type=int, default=None, help="Mask token for the draft slots. [default: the store's]")
@click.option("--drafter-config", default=None, help="Take the architecture (sizes, layer types, window, RoPE) from this config.json, e.g. a released "
                   "drafter's; taps, vocab and mask come from the store; size flags override it.")
@click.option("--init-from", default=None, help="Start from this drafter checkpoint (loaded strictly; must fit the store). Its architecture and "
                   "block size are used; size flags are ignored.")
@click.option("--resume", default=None, is_flag=False, flag_value="latest",
              help="Continue from OUT's latest step-N (bare flag) or from the given step directory.")
@click.option("--mixed-precision", type=click.Choice(["auto", "bf16", "no"]), default="auto", show_default=True,
              help="auto: bf16 autocast with fp32 master weights on GPU, fp32 on CPU.")
@click.option("--audit", is_flag=True, help="Write OUT/audit/rank-N.json: world size, samples read, parameter hash.")
def main(**kw) -> None:
    from stages.train import TrainConfig, run

    summary = run(TrainConfig(**kw), log=lambda m: click.echo(m, err=True))
    if os.environ.get("RANK", "0") != "0":
        return
    ev = summary["final_eval"]
    click.echo(f"done: {summary['steps']} steps, checkpoint {summary['out']}/final"
               + (f"; held-out loss {ev['loss']:.4f}, streak tau {ev['tau_streak']:.3f}" if ev else ""))


if __name__ == "__main__":
    from pipeline.errors import run_command

    run_command(main, "interrupted; rerun with --resume to continue from the last step-N")
