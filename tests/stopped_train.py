"""`python train.py ARGS` that stops as if interrupted right after writing step-N (for the resume
tests):  python -m tests.stopped_train N ARGS...

The stop comes from outside: it wraps the stage's `save_step`, so production code carries no test
hook. Everything else is the real command, with its real interrupt handling."""

import sys

import train
from stages.command import run_command
from stages.train import run

STOP_AFTER = int(sys.argv.pop(1))
_save_step = run.save_step


def save_step(s, config, step):
    _save_step(s, config, step)
    if step == STOP_AFTER:
        raise KeyboardInterrupt(f"stopped after step {step}")


run.save_step = save_step
run_command(train.main, run.INTERRUPTED)
