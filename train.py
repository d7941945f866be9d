"""Stage two: train a DFlash drafter purely from a hidden-state store. (An entry point.)

accelerate launch train.py --store hs.zarr --out runs/NAME [--eval-shards 60-63] ...
"""

import click

from stages.command import CONTEXT, log, options, run_command
from stages.paths import check_inputs
from stages.train.config import TrainConfig


@click.command(context_settings=CONTEXT)
@options(TrainConfig)
def main(config: TrainConfig) -> None:
    """Train a DFlash drafter from the --store (written by `pipeline extract`); no target model is loaded.

    \b
    Single process:   python train.py --store hs.zarr --out runs/a --eval-shards 60-63
    8 GPUs:           accelerate launch --multi_gpu --num_processes 8 train.py --store hs.zarr ...
    2 CPU processes:  accelerate launch --multi_gpu --num_processes 2 train.py ... (real DDP on CPU)

    Writes OUT/metrics.jsonl, OUT/step-N/ every --save-every steps (a drafter checkpoint in the
    public DFlash layout plus the training state) and OUT/final/. --resume continues a stopped run
    exactly (same flags, same number of processes).
    """
    check_inputs(config.data.store, config.run.out)  # before torch is imported: a mistake answers at once
    from stages.train.run import done_line, run

    summary = run(config, log=log)
    if summary["main_process"]:
        click.echo(done_line(summary))


if __name__ == "__main__":
    from stages.train.recipe import INTERRUPTED

    run_command(main, INTERRUPTED)
