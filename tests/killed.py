"""`python train.py ARGS` or `python evaluate.py ARGS` killed with SIGKILL at a chosen point (for
the fault tests):  python -m tests.killed train|evaluate POINT ARGS...

POINT is WHERE:STEP. For train, WHERE is one of
  step            at the start of optimizer step STEP (1-based), between checkpoints
  training-state  while step-STEP is being saved: the trainer state written, the drafter not yet
  trainer-index   while step-STEP's trainer state is being saved: every rank's data file written,
                  DCP's .metadata (written last) not yet
  weights         while step-STEP is being saved: its model.safetensors half written
  publish         step-STEP complete in its hidden directory, not yet renamed into place
  prune           step-STEP published, older checkpoints not yet pruned
  final           OUT/final's model.safetensors half written (STEP ignored)
For evaluate:
  replay          in the middle of the replay, after STEP prompts
  report          report.json written to its temporary name, not yet renamed into place
The kill comes from outside: it wraps the stage's functions, so production code carries no test
hook. Everything else is the real command."""

import os
import signal
import sys

from pipeline.decode import batch_replay
from pipeline.drafter import checkpoint
from stages.command import run_command
from stages.evaluate import report
from stages.train import run, run_dir

PROGRAM = sys.argv.pop(1)
WHERE, _, STEP = sys.argv.pop(1).partition(":")
STEP = int(STEP or 0)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def wrap(module, name, before=None, after=None):
    real = getattr(module, name)

    def wrapped(*args, **kw):
        if before and before(*args, **kw):
            die()
        out = real(*args, **kw)
        if after and after(*args, **kw):
            die()
        return out

    setattr(module, name, wrapped)


def half_written(tensors, path, **kw) -> bool:
    """Write the file, then cut it in half: the state a kill in the middle of the write leaves."""
    wanted = f".step-{STEP}.tmp" in path if WHERE == "weights" else "/.final.tmp" in path
    if wanted:
        with open(path, "r+b") as fh:
            fh.truncate(os.path.getsize(path) // 2)
    return wanted


def replayed_enough(self, *args, **kw) -> bool:
    replayed_enough.prompts += 1
    return replayed_enough.prompts > STEP


replayed_enough.prompts = 0

if WHERE == "replay":
    wrap(batch_replay.BatchReplay, "_take", before=replayed_enough)
elif WHERE == "report":
    wrap(report.os, "replace", before=lambda src, dst: str(dst).endswith("report.json"))
elif WHERE == "step":
    wrap(run, "train_step", before=lambda s, config, batches, step, seen: step + 1 == STEP)
elif WHERE == "training-state":
    wrap(
        run_dir, "write_drafter", before=lambda setup, config, directory, step, atomic=True: step == STEP and not atomic
    )
elif WHERE == "trainer-index":
    from torch.distributed.checkpoint import filesystem

    wrap(filesystem.FileSystemWriter, "finish", before=lambda writer, *a, **k: f".step-{STEP}.tmp" in str(writer.path))
elif WHERE in ("weights", "final"):
    wrap(checkpoint, "save_file", after=half_written)
elif WHERE == "publish":
    wrap(checkpoint, "publish", before=lambda tmp, directory: directory.name == f"step-{STEP}")
elif WHERE == "prune":
    wrap(run_dir, "prune_steps", before=lambda out, newest, keep: newest == STEP)
else:
    raise SystemExit(f"unknown kill point {WHERE}")
if PROGRAM == "train":
    import train

    run_command(train.main, run.INTERRUPTED)
else:
    import evaluate

    run_command(evaluate.main)
