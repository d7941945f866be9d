"""`pipeline ARGS` that stops after N extraction batches and waits to be killed (for the tests of
real process faults):  python -m tests.paused_cli N ARGS...

It prints `PAUSED shard=S` to stderr once the N-th batch of the run was handed to the shard writer,
then sleeps; everything else is the real command. The pause comes from outside: it wraps the
stage's public `Extractor.finish`, so production code carries no test hook."""

import sys
import time

from pipeline.cli import main
from stages.extract.extractor import Extractor

PAUSE_AFTER = int(sys.argv.pop(1))
_finish = Extractor.finish
_done = []


def finish(self, batch, writer, shard):
    _finish(self, batch, writer, shard)
    _done.append(shard)
    if len(_done) == PAUSE_AFTER:
        print(f"PAUSED shard={shard}", file=sys.stderr, flush=True)
        for _ in range(36000):  # short sleeps: a signal the kernel hands another thread runs its
            time.sleep(0.1)  # Python handler only once the main thread runs again


Extractor.finish = finish
main()
