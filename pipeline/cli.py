"""`pipeline`: extract hidden states into a store, describe it, verify it; export a drafter; plan a run.
(An entry point.)"""

import json
import os
import signal
import sys

import click

from stages.command import CONTEXT, log, options, run_command
from stages.export.config import ExportConfig
from stages.extract.config import ExtractConfig
from stages.plan.config import PlanConfig
from store.errors import UserError


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


@click.group(context_settings=CONTEXT)
def cli() -> None:
    """dflash-pipeline: hidden-state stores for training DFlash drafters."""


@cli.command()
@options(ExtractConfig)
@click.option("--json", "as_json", is_flag=True, help="Print the final summary as JSON.")
def extract(config: ExtractConfig, as_json: bool) -> None:
    """Run the target over a prompt set and write tap-layer hidden states to a Zarr store.

    \b
    Every default points at the shipped tiny target and its prompt set, so
        pipeline extract --shards 0-3
    works on a fresh install. A rerun skips committed shards and redoes a partial
    one; processes on disjoint --shards ranges can fill one store at the same time.
    """
    from stages.extract import run, summary

    signal.signal(signal.SIGTERM, _interrupt)
    try:
        result = run.run(config, log=log)
    except KeyboardInterrupt:
        raise UserError(run.INTERRUPTED) from None
    click.echo(json.dumps(result, indent=1, default=str) if as_json else summary.render(result))


@cli.command()
@click.argument("store")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def info(store: str, as_json: bool) -> None:
    """Shards done and missing, samples, tokens, bytes, compression and provenance of STORE."""
    from store.hidden_store import HiddenStore
    from store.summary import render, summarize

    opened = HiddenStore(store)
    opened.check_reachable()
    s = summarize(opened)
    click.echo(json.dumps(s, indent=1) if as_json else render(s))


@cli.command()
@click.argument("store")
@click.option(
    "--shards",
    "shard_text",
    default=None,
    help="Check only these shards ('0-63', 'all'); each must be committed. [default: every committed shard]",
)
@click.option(
    "--sample",
    type=click.FloatRange(0, 1, min_open=True),
    default=None,
    help="Decode only this share of each shard's state chunks, chosen at random (each checked against its "
    "own checksum in a schema-2 store), and recheck the final state (--final-state stores) on this share of "
    "each shard's samples; the verdict states the coverage. [default: every byte]",
)
@click.option(
    "--processes",
    type=click.IntRange(min=1),
    default=None,
    help="Shards checked in parallel processes (at most one per shard). [default: the cores this process may use]",
)
def verify(store: str, shard_text: str | None, sample: float | None, processes: int | None) -> None:
    """Re-read the committed shards of STORE; check shapes, offsets, masks and checksums (and, in a store
    made with --final-state, that the argmax of lm_head(final state) is the next token).

    Exits non-zero and names the shard on any corrupt shard, or on a shard named by --shards
    that is not committed.
    """
    from tqdm import tqdm

    from pipeline.target import final_state
    from store.hidden_store import HiddenStore
    from store.verify import verify_store

    opened = HiddenStore(store)
    opened.check_reachable()
    with tqdm(unit="shard", desc="verify", disable=None, file=sys.stderr) as bar:
        report = verify_store(
            store, shard_text, lambda _shard: bar.update(), sample, processes or len(os.sched_getaffinity(0))
        )
    if opened.layout.final_state:  # its rate recomputed from the stored final states and lm_head
        sound = [s for s in report.checked if s not in report.problems]
        totals, problems = final_state.recheck(opened, sound, sample)
        for shard, problem in problems.items():
            report.problems[shard] = [problem]
        log(final_state.describe(totals, opened.attrs.compat))
    for line in report.lines():
        log(line)
    click.echo(report.verdict())
    if not report.ok:
        sys.exit(1)


@cli.command()
@click.argument("checkpoint")
@click.argument("out_dir")
@options(ExportConfig)
def export(checkpoint: str, out_dir: str, config: ExportConfig) -> None:
    """Write CHECKPOINT (a run's step-N or final, or any DFlash drafter) to OUT_DIR for serving.

    \b
    OUT_DIR gets exactly config.json (with auto_map), model.safetensors (bf16, loaded and
    checked strictly), modeling_dflash.py and README.md: a model card with the target, taps,
    training record, the --report's replay tau and the serving caveats (also printed as warnings).
    """
    from stages.export import run

    click.echo(run.summary(run.run(checkpoint, out_dir, config, log=log)))


@cli.command()
@options(PlanConfig)
def plan(config: PlanConfig) -> None:
    """Size a run on paper: the store, the node cache, the capture batch, each stage's GPU memory,
    GPU-hours and wall time.

    \b
    From a target (a directory's config.json or a published architecture), the dataset's size, the
    store format and the cluster; every rate says whether it is measured (its result file) or
    arithmetic. A plan that would not fit (weights or a stage larger than a GPU, a node's share
    larger than its cache) is refused in one line. The defaults are docs/scale.md's 27B run.
    """
    from stages.plan import report, run

    click.echo(report.render(run.run(config)))


def main() -> None:
    run_command(cli, "aborted")


if __name__ == "__main__":
    main()
