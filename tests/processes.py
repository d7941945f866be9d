"""The three commands in real processes, as a user runs them (one thread each, so results are
identical across processes)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, SMALL


def cli_args(store: Path, dataset: Path, shards: str, num_shards: int = 4, **over) -> list[str]:
    opts = {**SMALL, **over}
    args = [
        "extract",
        "--store",
        str(store),
        "--dataset",
        str(dataset),
        "--shards",
        shards,
        "--num-shards",
        str(num_shards),
    ]
    for k, v in opts.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def _default_sigint() -> None:
    # A shell that starts a job in the background ignores SIGINT for it, and an ignored SIGINT is
    # inherited: Python would then never raise KeyboardInterrupt. Give the child the default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def pipeline_proc(args: list[str], pause_after: int | None = None, nproc: int | None = None, **kw) -> subprocess.Popen:
    """`pipeline ...` in a subprocess, one thread so results are identical across processes. With
    pause_after=N it prints PAUSED and waits to be killed after N batches (tests/paused_cli.py);
    with nproc=N it runs as N processes under torchrun."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **kw.pop("env", {})}
    program = ["pipeline"] if pause_after is None else ["tests.paused_cli", str(pause_after)]
    launcher = [] if nproc is None else ["torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "-m"]
    return subprocess.Popen(
        [sys.executable, "-m", *launcher, *program, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
        **kw,
    )


def run_pipeline(args: list[str], timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    p = pipeline_proc(args, **kw)
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


TINY = ["--workers", "1", "--anchors", "16", "--num-layers", "1", "--batch-size", "2", "--log-every", "1"]


def cpu_ddp(processes: int, port: int | None = None) -> list[str]:
    """accelerate launch of `processes` CPU processes with real DDP (--multi_gpu, gloo: `--cpu
    --num_processes N` would start one), rank 0 listening on `port` (None: a free one)."""
    from tests.engines import free_port

    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        str(processes),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(port or free_port()),
    ]


def train(args, launcher=(), stop_after=None, timeout=300) -> subprocess.CompletedProcess:
    """train.py in a subprocess; with stop_after=N, interrupted right after step-N (tests/stopped_train.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    program = ["train.py"] if stop_after is None else ["-m", "tests.stopped_train", str(stop_after)]
    return subprocess.run(
        [*launcher, *(() if launcher else (sys.executable,)), *program, *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def evaluate(store, checkpoint, shards: str, out, *extra: str) -> subprocess.CompletedProcess:
    """evaluate.py in a subprocess, fp32, on `shards` of `store`, its report written to `out`."""
    args = ["--store", store, "--checkpoint", checkpoint, "--shards", shards, "--dtype", "fp32", "--out", out]
    return subprocess.run(
        [sys.executable, "evaluate.py", *map(str, args), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )


def report(out) -> dict:
    """The first checkpoint's entry of evaluate.py's report in `out`."""
    return json.loads((Path(out) / "report.json").read_text())["checkpoints"][0]


def losses(out) -> list[float]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r["split"] == "train"]
