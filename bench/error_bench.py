"""What a mistake costs: CPU seconds from a command started to its `error:` line, for five mistakes, on
this checkout and, given --before, on another (the code before the change), one thread each.

    git worktree add /tmp/before <commit>
    python bench/error_bench.py --store hs.zarr --checkpoint runs/a/final --before /tmp/before \
        [--runs 5] [--json bench/results/errors_cpu.json]

Each command runs --runs times in a fresh process (OMP_NUM_THREADS=1) from the checkout's root;
the figure is the median of the child's user + system CPU seconds (wall seconds beside it). The
first line of stderr that starts with `error:` is kept, or `traceback` when the command ended in one.
--store and --checkpoint must be a store and a drafter that fit it: the --out mistake needs a run
that would otherwise work (before the change it replayed every prompt, then failed on --out).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import emit  # noqa: E402


def mistakes(store: str, checkpoint: str, tmp: Path) -> dict[str, list[str]]:
    """name -> the command's arguments after the Python executable."""
    note = tmp / "notes.txt"
    note.write_text("not a store\n")
    return {
        "train.py: a bad flag value (--epochs 0)": ["train.py", "--store", store, "--epochs", "0"],
        "train.py: --store is a file": ["train.py", "--store", str(note), "--out", str(tmp / "run")],
        "evaluate.py: --store does not exist": ["evaluate.py", "--store", str(tmp / "none.zarr"), "--checkpoint",
                                                checkpoint, "--out", str(tmp / "report")],
        "evaluate.py: --out under a file": ["evaluate.py", "--store", store, "--checkpoint", checkpoint, "--out",
                                            str(note / "report")],
        "pipeline extract: a bad flag value (--compression-level 99)": ["-m", "pipeline", "extract", "--store",
                                                                         str(tmp / "new.zarr"), "--compression-level",
                                                                         "99"],
    }


def measure(code: Path, args: list[str], runs: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(code)}
    cpu, wall, p = [], [], None
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, *args], cwd=code, env=env, capture_output=True, text=True)
        wall.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    said = "traceback: " + p.stderr.strip().splitlines()[-1] if "Traceback" in p.stderr else (errors or ["-"])[0]
    return {"cpu_s": round(statistics.median(cpu), 2), "wall_s": round(statistics.median(wall), 2),
            "cpu_s_each": [round(c, 2) for c in cpu], "exit": p.returncode, "said": said}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True, help="a store (pipeline extract)")
    p.add_argument("--checkpoint", required=True, help="a drafter that fits --store")
    p.add_argument("--before", type=Path, help="a checkout of the code before the change")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    store, checkpoint = str(Path(args.store).resolve()), str(Path(args.checkpoint).resolve())
    trees = {"before": args.before.resolve(), "after": ROOT} if args.before else {"after": ROOT}
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cmd in mistakes(store, checkpoint, Path(tmp)).items():
            rows[name] = {"command": " ".join(cmd), **{k: measure(tree, cmd, args.runs) for k, tree in trees.items()}}
            print(f"{name}: " + ", ".join(f"{k} {v['cpu_s']} s CPU" for k, v in rows[name].items() if k != "command"),
                  file=sys.stderr)
    emit({"runs": args.runs, "threads": 1, "cores": os.cpu_count(), "load_avg": os.getloadavg()[0],
          "figure": "median CPU seconds (user + system) of the command's process, start to exit",
          "mistakes": rows}, args.json)


if __name__ == "__main__":
    main()
