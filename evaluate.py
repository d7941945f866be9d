"""Evaluate DFlash drafters: tau by replaying greedy speculative decoding from a hidden-state store.
(An entry point.)  python evaluate.py --store hs.zarr --checkpoint runs/a/final [--checkpoint DIR2]"""

import json

import click

from stages.command import CONTEXT, log, options, run_command
from stages.evaluate.config import EvalConfig
from stages.paths import check_inputs


@click.command(context_settings=CONTEXT)
@options(EvalConfig)
@click.option("--json", "as_json", is_flag=True, help="Print the whole report as JSON instead of the table.")
def main(config: EvalConfig, as_json: bool) -> None:
    """Replay greedy speculative decoding from the --store's states and greedy completions and report
    the acceptance length tau of each --checkpoint (ours or a released DFlash drafter). Several
    processes (torchrun / accelerate launch) each replay their part of the prompts.

    \b
    Writes OUT/report.json, OUT/report.md, OUT/histogram.png and OUT/per_slot.png, and prints a table.
    tau = mean over prompts of each prompt's mean tokens per round (bonus token counted); the pooled mean,
    acceptance histogram and per-slot acceptance too. DDTree-N: a tree of N nodes from the same drafter.
    A checkpoint of another conditioning (target, kernels, dtype, taps, tokenizer, mask token, format
    but fp8 on bf16) is refused unless --allow-mismatch; one of other data (a benchmark store) replays
    --shards, else --store's committed shards (its held-out ones where they number --store's prompts).
    """
    check_inputs(config.store, config.out)  # before torch is imported: a mistake answers at once
    from stages.evaluate.report import console
    from stages.evaluate.run import run

    rep = run(config, log=log)  # None on the other processes of a launch
    if rep is not None:
        click.echo(json.dumps(rep, indent=1) if as_json else console(rep))
        log(f"report: {config.out}/report.md, report.json, histogram.png, per_slot.png")


if __name__ == "__main__":
    run_command(main)
