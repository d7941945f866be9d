"""`pipeline ARGS` that stops after N extraction batches and waits to be killed (for the tests of
real process faults):  python -m tests.paused_cli N ARGS...

It prints `PAUSED shard=S` to stderr once the N-th batch of the run was handed to the shard writer,
then sleeps; everything else is the real command. The pause comes from outside: it wraps the
stage's public `Extractor.batch`, so production code carries no test hook."""

import sys
import time

from pipeline.cli import main
from stages.extract.run import Extractor

PAUSE_AFTER = int(sys.argv.pop(1))
_batch = Extractor.batch
_done = []


def batch(self, rows, writer):
    _batch(self, rows, writer)
    _done.append(writer.shard)
    if len(_done) == PAUSE_AFTER:
        print(f"PAUSED shard={writer.shard}", file=sys.stderr, flush=True)
        time.sleep(3600)


Extractor.batch = batch
main()
