"""Evaluate DFlash drafters: tau by replaying greedy speculative decoding from a hidden-state store.

    python evaluate.py --store hs.zarr --checkpoint runs/a/final [--checkpoint DIR2 ...] [--ddtree 8,16,32,64]

Parses flags into an EvalConfig and calls stages.evaluate.run; errors are one line.
"""

from __future__ import annotations


import click

HELP = """Replay greedy speculative decoding from the --store's states and greedy completions and report
the acceptance length tau of each --checkpoint (ours or a released DFlash drafter).

\b
Writes OUT/report.json, OUT/report.md, OUT/histogram.png and OUT/per_slot.png, and prints a table.
tau = mean over prompts of each prompt's mean tokens per round (bonus token counted); the pooled
mean, the histogram of accepted drafts and per-slot acceptance are reported too. DDTree-N means a
tree of N nodes drafted from the same drafter.
A checkpoint trained on another store (fingerprint: target, taps, backend, tokenizer, data) is
refused unless --allow-mismatch.
"""


def _budgets(_ctx, _param, value: str) -> tuple[int, ...]:
    if value in (None, "", "none"):
        return ()
    try:
        return tuple(int(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected budgets such as '8,16,32,64' or 'none'") from None


@click.command(help=HELP, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--store", default="hs.zarr", show_default=True, help="Hidden-state store (path or fsspec URL).")
@click.option("--checkpoint", "checkpoints", multiple=True, required=True,
              help="Drafter checkpoint directory (config.json + model.safetensors); repeat to compare several.")
@click.option("--shards", default=None,
              help="Shards to replay, e.g. '56-63'. [default: the checkpoint's held-out shards if recorded, else all]")
@click.option("--ddtree", default="8,16,32,64", show_default=True, callback=_budgets,
              help="DDTree node budgets to report ('none' for chain drafting only).")
@click.option("--out", default="report", show_default=True, help="Report directory.")
@click.option("--max-rounds", type=int, default=None, help="Stop each prompt after this many rounds.")
@click.option("--max-prompts", type=int, default=None, help="Replay only the first N prompts of the shards.")
@click.option("--allow-mismatch", is_flag=True,
              help="Evaluate a checkpoint whose store fingerprint, taps or mask token differ (the report says so at the top).")
@click.option("--live", is_flag=True,
              help="Also run real greedy speculative decoding with the target (verify each block in one pass, roll "
                   "back the hybrid state on rejection); reports tau, tokens/s vs target-only greedy, and agreement "
                   "with replay.")
@click.option("--target", default=None, help="The store's target model directory, for --live.")
@click.option("--device", default=None, help="torch device. [default: cuda if available, else cpu]")
@click.option("--threads", type=int, default=1, show_default=True,
              help="CPU intra-op threads. Replay is many small ops: on an idle 2-core machine two threads were ~10% "
                   "faster than one, but 40x slower while another program was busy.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole report as JSON instead of the table.")
def main(as_json: bool, device: str | None, **kw) -> None:
    import json

    from pipeline.report import console
    from stages.evaluate import EvalConfig, run

    if device:
        kw["device"] = device
    rep = run(EvalConfig(**kw), log=lambda m: click.echo(m, err=True))
    click.echo(json.dumps(rep, indent=1) if as_json else console(rep))
    click.echo(f"report: {kw['out']}/report.md, report.json, histogram.png, per_slot.png", err=True)


if __name__ == "__main__":
    from pipeline.errors import run_command

    run_command(main)
