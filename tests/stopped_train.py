"""`python train.py ARGS` that stops as if interrupted right after writing step-N (for the resume
tests):  python -m tests.stopped_train N [--accelerate-layout] ARGS...

--accelerate-layout: step-N's training/ written as runs did before the trainer state
(stages/train/trainer_state.py): Accelerate's save_state by the main process, and with several
processes each rank's share of Muon's momentum beside it.

The stop comes from outside: it wraps the stage's `save_step`, so production code carries no test
hook. Everything else is the real command, with its real interrupt handling."""

import sys

import torch

import train
from stages.command import run_command
from stages.train import run, trainer_state
from stages.train.run_dir import MOMENTUM, muons

STOP_AFTER = int(sys.argv.pop(1))
_save_step = run.save_step


def owned(muon) -> dict:
    """A rank's momentum buffers by matrix index: its shard in Accelerate's layout (muon-momentum-rank-R.pt)."""
    return {i: s["momentum_buffer"] for i, (p, _) in enumerate(muon.matrices()) if (s := muon.state.get(p))}


def accelerate_layout(directory, acc, raw, optimizers, schedulers) -> None:
    acc.save_state(str(directory))
    for muon in muons(optimizers):
        if acc.num_processes > 1:
            torch.save(owned(muon), directory / MOMENTUM.format(acc.process_index))


if sys.argv[1] == "--accelerate-layout":
    sys.argv.pop(1)
    trainer_state.save = accelerate_layout


def save_step(s, config, step):
    _save_step(s, config, step)
    if step == STOP_AFTER:
        raise KeyboardInterrupt(f"stopped after step {step}")


run.save_step = save_step
run_command(train.main, run.INTERRUPTED)
