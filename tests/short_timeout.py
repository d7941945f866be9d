"""`python evaluate.py ARGS` whose process group gives up on a collective after SECONDS (the
default is 30 minutes), for the launch tests:  python -m tests.short_timeout SECONDS ARGS...

The timeout is set from outside, on torch's default, so production code carries no test hook."""

import sys
from datetime import timedelta

import torch.distributed.distributed_c10d as c10d

import evaluate
from stages.command import run_command

c10d.default_pg_timeout = timedelta(seconds=float(sys.argv.pop(1)))
run_command(evaluate.main)
