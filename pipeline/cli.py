"""`pipeline`: extract hidden states into a store, describe it, verify it."""

from __future__ import annotations

import json
import signal
import sys

import click

from pipeline.errors import PipelineError, run_command

EXTRACT_HELP = """Run the target over a prompt set and write tap-layer hidden states to a Zarr store.

\b
Every default points at the shipped tiny target and its prompt set, so
    pipeline extract --shards 0-3
works on a fresh install. A rerun skips committed shards and redoes a partial
one; processes on disjoint --shards ranges can fill one store at the same time.
"""


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def cli() -> None:
    """dflash-pipeline: hidden-state stores for training DFlash drafters."""


@cli.command(help=EXTRACT_HELP)
@click.option("--store", default="hs.zarr", show_default=True, help="Store path or fsspec URL (created if absent).")
@click.option("--shards", "shard_text", default="0-63", show_default=True,
              help="Shards this process writes, e.g. '0-63' or '0-3,8,10-12'.")
@click.option("--num-shards", type=int, default=None,
              help="Shards the dataset is split into; fixed when the store is created. [default: the store's, or 64]")
@click.option("--target", default=None, help="Target model directory or hub id. [default: the shipped tiny target]")
@click.option("--dataset", default=None,
              help="Prompts: .jsonl, .json, .parquet, a saved `datasets` directory or a hub dataset name. "
                   "[default: the shipped prompt set]")
@click.option("--split", default="train", show_default=True, help="Split, for `datasets` sources.")
@click.option("--messages-field", default="messages", show_default=True, help="Field holding chat turns.")
@click.option("--prompt-field", default="prompt", show_default=True, help="Field holding a plain prompt (if no messages).")
@click.option("--response-field", default="response", show_default=True,
              help="Field holding the response for plain prompts (--responses dataset).")
@click.option("--responses", type=click.Choice(["regenerate", "dataset"]), default="regenerate", show_default=True,
              help="regenerate: the target's greedy completion; dataset: the dataset's own assistant turn.")
@click.option("--max-new-tokens", type=int, default=256, show_default=True, help="Completion length limit.")
@click.option("--max-length", type=int, default=1024, show_default=True,
              help="Prompt + completion limit; longer prompts are skipped and counted.")
@click.option("--batch-size", type=int, default=16, show_default=True, help="Prompts per generate/capture batch.")
@click.option("--device", default=None, help="torch device. [default: cuda if available, else cpu]")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True,
              help="Dtype the target runs in (states are stored as bf16 either way).")
@click.option("--linear-attention", type=click.Choice(["auto", "fla", "torch"]), default="auto", show_default=True,
              help="Gated DeltaNet kernels: auto = fla on CUDA when installed, else the PyTorch fallback "
                   "(always the fallback without CUDA). What actually ran is recorded in the store.")
@click.option("--taps", default=None,
              help="Tap layers: '1,16,31' (layer ids, 0-based; tap k = output of layer k) or 'n=5'. "
                   "[default: the DFlash formula with 5 taps]")
@click.option("--mask-token-id", type=int, default=None, help="Drafter mask token. [default: the tokenizer's mask token]")
@click.option("--chunk-tokens", type=int, default=256, show_default=True, help="Tokens per compressed chunk.")
@click.option("--shard-tokens", type=int, default=4096, show_default=True,
              help="Tokens per zarr shard file (a multiple of --chunk-tokens).")
@click.option("--compression-level", type=int, default=3, show_default=True, help="Lossless zstd level, 0-9.")
@click.option("--json", "as_json", is_flag=True, help="Print the final summary as JSON.")
def extract(shard_text: str, as_json: bool, **kw) -> None:
    from pipeline import DEFAULT_PROMPTS, TINY_TARGET
    from stages import extract as stage

    kw["target"] = kw["target"] or str(TINY_TARGET)
    kw["dataset"] = kw["dataset"] or str(DEFAULT_PROMPTS)
    if kw["device"] is None:
        kw.pop("device")
    config = stage.ExtractConfig(**kw)
    shard_ids = stage.resolve_shards(config, shard_text)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        summary = stage.run(config, shard_ids, log=lambda m: click.echo(m, err=True))
    except KeyboardInterrupt:
        raise PipelineError("interrupted: committed shards are kept, the shard in progress is left uncommitted; "
                            "rerun the same command to resume") from None
    click.echo(json.dumps(summary, indent=1, default=str) if as_json else render_summary(summary))


def render_summary(s: dict) -> str:
    from pipeline.ranges import format_ranges
    from store.summary import fmt_skips, human_bytes

    t = s["timing"]
    ratio = f"{s['compression_ratio']}x" if s["compression_ratio"] else "n/a"
    return "\n".join([
        f"wrote {len(s['shards_written'])} shard(s) ({format_ranges(s['shards_written']) or 'none'}), "
        f"skipped {len(s['shards_skipped'])} already committed ({format_ranges(s['shards_skipped']) or 'none'})",
        f"samples {s['samples']}, tokens {s['tokens']} ({s['tokens_per_s']:.0f} tokens/s over {s['wall_s']:.1f}s); "
        f"skipped rows: {fmt_skips(s['skipped'])}; completions cut at the limit: {s['truncated']}",
        f"store {s['store']}: {s['shards_done']}/{s['num_shards']} shards committed, "
        f"{human_bytes(s['bytes_on_disk'])} on disk; hidden states {human_bytes(s['hidden_bytes_on_disk'])} "
        f"vs {human_bytes(s['hidden_bytes_raw_bf16'])} raw bf16 ({ratio})",
        f"backend: linear attention {s['backends']['linear_attention']}, attention {s['backends']['attention']}; "
        f"time in generate {t['generate_s']:.1f}s, capture {t['capture_s']:.1f}s, prepare {t['prepare_s']:.1f}s, "
        f"waiting on the writer {t['stall_s']:.2f}s",
    ])


@cli.command()
@click.argument("store")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def info(store: str, as_json: bool) -> None:
    """Shards done and missing, samples, tokens, bytes, compression and provenance of STORE."""
    from store.hidden_store import HiddenStore
    from store.summary import render, summarize

    s = summarize(HiddenStore(store))
    click.echo(json.dumps(s, indent=1) if as_json else render(s))


@cli.command()
@click.argument("store")
@click.option("--shards", "shard_text", default=None,
              help="Shards that must be committed (missing ones fail). [default: only check committed shards]")
def verify(store: str, shard_text: str | None) -> None:
    """Re-read every committed shard of STORE; check shapes, offsets, masks and checksums.

    Exits non-zero and names the shard on any corrupt shard, or on a shard named by --shards
    that is not committed.
    """
    from pipeline.ranges import format_ranges, parse_ranges
    from store.hidden_store import HiddenStore
    from store.verify import verify as run_verify

    from tqdm import tqdm

    hs = HiddenStore(store)
    expected = parse_ranges(shard_text, hs.num_shards) if shard_text else None
    with tqdm(total=len(hs.committed()), unit="shard", desc="verify", disable=None, file=sys.stderr) as bar:
        report = run_verify(hs, expected, progress=lambda _shard: bar.update())
    for shard, problems in sorted(report.problems.items()):
        where = "root" if shard < 0 else f"shard {shard}"
        for p in problems:
            click.echo(f"CORRUPT {where}: {p}", err=True)
    if report.missing:
        click.echo(f"MISSING shards {format_ranges(report.missing)}: not committed", err=True)
    if report.partial:
        click.echo(f"note: shards {format_ranges(report.partial)} hold uncommitted data (a rerun redoes them)", err=True)
    click.echo(f"checked {len(report.checked)} committed shard(s): "
               + ("all good" if report.ok else f"{len(report.problems)} corrupt, {len(report.missing)} missing"))
    if not report.ok:
        sys.exit(1)


def main() -> None:
    run_command(cli, "aborted")


if __name__ == "__main__":
    main()
