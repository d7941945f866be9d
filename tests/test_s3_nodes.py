"""Two "nodes" on this machine: 2 x 2 training processes (two torchrun launches joined in one
rendezvous), each node with its own local cache directory, the store on S3 (moto's server on
127.0.0.1). The run trains with the node-affine order, is SIGKILLed on both nodes after a save,
resumes, and the drafter is evaluated from the same store. Opt-in: `pytest -m s3`."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.processes import REPO, TINY, evaluate, losses, report, run_pipeline
from tests.s3 import extract_args

pytestmark = pytest.mark.s3
STEPS, SAVE = 8, 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(rank: int, port: int, args: list) -> subprocess.Popen:
    """One node's torchrun: 2 processes, the rendezvous on 127.0.0.1."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--node_rank",
        str(rank),
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        "train.py",
        *map(str, args),
    ]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def both(args_of, timeout: float = 900) -> list[subprocess.CompletedProcess]:
    port = free_port()
    procs = [node(k, port, args_of(k)) for k in (0, 1)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, o, e) for p, (o, e) in zip(procs, outs)]


def tree(pid: int) -> list[int]:
    """pid and every process below it (torchrun starts its workers in sessions of their own)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in os.listdir(f"/proc/{p}/task") if os.path.isdir(f"/proc/{p}/task") else []:
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
            except OSError:
                pass
    return out


def cached_shards(cache) -> set[int]:
    """The store shards whose files a node's cache holds (shards/NNNNN/... under its store folder)."""
    return {int(p.name) for p in cache.rglob("*") if p.is_dir() and p.parent.name == "shards" and p.name.isdigit()}


def test_two_nodes_train_resume_after_a_kill_and_evaluate(s3, small_dataset, tmp_path):
    store = "s3://bucket/nodes.zarr"
    p = run_pipeline(extract_args(store, small_dataset, "0-3"))
    assert p.returncode == 0, p.stderr[-2000:]
    out = tmp_path / "run"
    caches = [tmp_path / f"node{k}-cache" for k in (0, 1)]

    def args(k: int) -> list:
        return [
            "--store",
            store,
            "--out",
            out,
            "--shards",
            "0-2",
            "--eval-shards",
            "3",
            "--max-steps",
            STEPS,
            "--save-every",
            SAVE,
            "--data-order",
            "node",
            "--cache-dir",
            caches[k],
            "--cache-size",
            "1G",
            "--audit",
            *TINY,
            "--batch-size",
            1,
            "--eval-replay-prompts",
            0,
        ]

    port = free_port()
    procs = [node(k, port, args(k)) for k in (0, 1)]
    deadline = time.monotonic() + 900
    while not (out / f"step-{SAVE}").is_dir():  # a save, then SIGKILL on both nodes (every process of each)
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [
            p.communicate()[1][-3000:] for p in procs if p.poll() is not None
        ]
        time.sleep(0.2)
    doomed = [q for p in procs for q in tree(p.pid)]
    for q in doomed:
        try:
            os.kill(q, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait()
    time.sleep(1)
    assert not (out / "final").exists()
    assert not any(os.path.exists(f"/proc/{q}") and open(f"/proc/{q}/stat").read().split()[2] != "Z" for q in doomed)

    runs = both(lambda k: [*args(k), "--resume"])
    for k, r in enumerate(runs):
        (tmp_path / f"resume-{k}.log").write_text(r.stdout + r.stderr)
    for r in runs:
        assert r.returncode == 0, [line for line in r.stderr.splitlines() if "rror" in line][:10]
    assert f"resumed from {out / f'step-{SAVE}'}" in runs[0].stderr + runs[0].stdout
    assert len(losses(out)) == STEPS
    audits = [json.loads((out / "audit" / f"rank-{i}.json").read_text()) for i in range(4)]
    assert [a["world_size"] for a in audits] == [4] * 4
    assert len({a["param_sha256"] for a in audits}) == 1
    held = [cached_shards(c) - {3} for c in caches]  # both validate on the held-out shard 3
    assert held[0] and held[1] and not held[0] & held[1], held  # each node read its own shards, once, locally
    read = [{s for a in audits[2 * k : 2 * k + 2] for s, _ in a["samples"]} for k in (0, 1)]
    assert not read[0] & read[1] and read[0] <= held[0] and read[1] <= held[1], (read, held)

    e = evaluate(store, out / "final", "3", tmp_path / "report")
    assert e.returncode == 0, e.stderr[-3000:]
    tau = report(tmp_path / "report")["tau"]
    assert tau >= 1.0
