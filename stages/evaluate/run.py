"""Evaluate drafters by replaying greedy speculative decoding from the store.

First every checkpoint is checked (its config and tensor shapes, its conditioning against the
store: conditioning.py). Then each in turn, one in memory at a time, is replayed on a seeded sample of
the chosen shards' prompts (chain drafting and DDTree-N for each budget, many prompts per forward:
pipeline/decode/batch_replay.py), each process of a launch its own part, gathered on rank 0.
Those gathers are the launch's only collectives: the other processes then leave, and rank 0 alone
runs --live (target load, baseline, one live run per drafter) and --served (an engine per drafter,
on the device the evaluator has freed: engine_device.py), which take as long as they take, and
writes the report (report.py).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tqdm import tqdm

from pipeline import device as devices
from pipeline.decode.acceptance import stats
from pipeline.decode.batch_replay import BatchReplay
from pipeline.errors import TargetError
from stages import cache_flags
from stages.evaluate import groups, process_group, report
from stages.evaluate.conditioning import Checked, build, check_checkpoint
from stages.evaluate.config import EvalConfig
from stages.evaluate.engine_device import choose as choose_engine
from stages.evaluate.prompts import Prompts
from stages.evaluate.shards import choose_shards
from store import index_file
from store.errors import StoreCorrupt, StoreError
from store.hidden_store import HiddenStore
from store.index_file import StoreIndex


def replay_part(m, prompts: Prompts, mine: list, config: EvalConfig, keep: set, label: str) -> dict:
    """This process's prompts replayed -> {"counts": [PromptCounts], "histogram": [P][B], "seconds"}."""
    slots, T = min(config.batch_prompts, max(1, len(mine))), config.temperature
    engine = BatchReplay(m, config.ddtree, slots, prompts.max_length, config.max_rounds, T)
    t0 = time.perf_counter()
    samples = prompts.read(mine, final_state=T is not None)
    counts = list(tqdm(engine.run(samples, keep), total=len(mine), desc=f"replay {label}", unit="prompt", disable=None))
    return {"counts": counts, "histogram": engine.histogram, "seconds": time.perf_counter() - t0}


def summarize_parts(
    parts: list[dict], budgets: tuple[int, ...], prompts: Prompts, temperature: float | None = None
) -> tuple[dict, dict]:
    """The ranks' parts -> (the checkpoint's results, chain rounds of the kept prompts by (shard, index))."""
    counts = sorted((c for p in parts for c in p["counts"]), key=lambda c: (c.shard, c.index))
    B = len(parts[0]["histogram"][0])

    def policy(lane: int) -> dict:
        hist = [sum(p["histogram"][lane][k] for p in parts) for k in range(B)]
        return stats([(c.rounds[lane], c.tokens[lane]) for c in counts], hist)

    chain, trees = policy(0), {str(b): policy(1 + i) for i, b in enumerate(budgets)}
    lane_rounds = sum(sum(c.rounds) for c in counts)
    seconds = max(p["seconds"] for p in parts)
    out = {
        **chain,
        "block_size": B,
        "ddtree": {b: t["tau"] for b, t in trees.items()},
        "ddtree_pooled": {b: t["tau_pooled"] for b, t in trees.items()},
        "ddtree_ci95": {b: t["tau_ci95"] for b, t in trees.items()},
        "replay_seconds": round(seconds, 3),
        "rounds_per_s": round(lane_rounds / seconds, 1) if seconds else None,
        "per_prompt": [
            {
                "shard": c.shard,
                "index": c.index,
                "row_id": c.row_id,
                "prompt_len": c.prompt_len,
                "completion_len": c.completion_len,
                "rounds": c.rounds[0],
                "tau": c.tau(0),
                "ddtree": {str(b): c.tau(1 + i) for i, b in enumerate(budgets)},
            }
            for c in counts
        ],
    }
    if temperature is not None:
        out["tau_at_temperature"] = {"temperature": temperature, **groups.sampled(counts)}
        for p, c in zip(out["per_prompt"], counts):
            p["tau_at_temperature"] = c.sampled_tokens / c.rounds[0] if c.rounds[0] else float("nan")
    out["per_category"] = groups.by_category(counts, budgets, prompts.category)
    out["per_context"] = groups.by_context(counts, budgets)
    return out, {(c.shard, c.index): c.chain_rounds for c in counts if c.chain_rounds is not None}


def run(config: EvalConfig, log=print) -> dict | None:
    """The report on rank 0; None on the other processes of a launch."""
    proc = devices.Process.from_env()
    device = proc.device(config.device or devices.default_device())
    if device == "cpu":
        devices.prepare_cpu(config.threads or devices.default_threads(proc.world))
    process_group.join(proc, device)
    try:
        with report.claimed(Path(config.out), owner=proc.rank == 0):  # before the replay, not after it
            return _run(config, proc, device, log if proc.rank == 0 else (lambda m: None))
    finally:
        process_group.leave(proc)


def _run(config: EvalConfig, proc, device: str, log) -> dict | None:
    store = HiddenStore(config.store, node_cache=cache_flags.make(config, lambda m: log(f"warning: {m}")))
    warnings: list[str] = list(filter(None, [store.read_checks().warning(), cache_flags.warning(config, store)]))
    checked = [check_checkpoint(p, store, config.allow_mismatch, warnings) for p in config.checkpoints]
    if config.temperature is not None:
        store.require_final_state("--temperature", config.temperature, "the target's p at T")
    index = _index(store)
    shards = choose_shards(config, store, checked, warnings, index.records if index.records else None)
    if proc.rank == 0:
        report.check_out(Path(config.out), config.force)  # before the replay, not after it
    prompts = Prompts(store, shards.ids, config.max_prompts, config.seed, index)
    if not prompts:
        raise StoreError(f"{config.store}: shards {shards.text} hold no prompt with a completion")
    served = _served_bench(config, store, prompts, warnings, log) if config.served else None  # checked before replay
    for w in warnings:
        log(f"warning: {w}")
    log(f"replaying shards {shards.text} of {config.store}: {shards.reason}")
    log(
        f"replaying {len(prompts)} of {prompts.available} prompts"
        + (f" on {proc.world} processes" if proc.world > 1 else "")
        + f", drafter in {config.dtype}"
    )
    live_refs = prompts.refs[: config.live_prompts] if config.live else []
    keep = set(live_refs) | (set(prompts.refs) if config.served else set())
    embed, lm_head = store.embeddings(("embed_tokens", "lm_head"))  # [V, H] bf16, read once, fetched together
    results, kept, where = replay_all(config, proc, device, prompts, checked, keep, (embed, lm_head))
    process_group.barrier(proc)
    process_group.leave(proc)  # the last collective is behind every process: rank 0's work below holds no one
    if proc.rank != 0:
        return None
    if live_refs:
        _live(config, store, prompts, live_refs, checked, results, kept, (embed, lm_head), device, warnings)
    del embed, lm_head
    devices.release(device)  # the engine below gets the device without the evaluator's tensors
    if served is not None:
        for x, res, rounds in zip(checked, results, kept):
            engine = choose_engine(config.served_device or device, config.served_memory)  # what is free now
            log(f"--served engine on {engine.text()}")
            res["served"] = served.run(x.path, x.config.block_size, [rounds[r] for r in prompts.refs], engine)
    sample = {
        "prompts": len(prompts),
        "available": prompts.available,
        "seed": config.seed,
        "live_prompts": len(live_refs) if config.live else None,
        "processes": proc.world,
        "devices": where,
        "dtype": config.dtype,
    }
    rep = report.build(config, store.attrs, shards, warnings, results, sample)
    report.write(rep, Path(config.out))
    return rep


def _index(store: HiddenStore) -> StoreIndex:
    """Every committed shard's record and per-sample arrays, in one file (store/index_file.py); empty
    when a commit file is damaged, so that only a chosen shard's damage stops the run (its own reads
    name it)."""
    try:
        return index_file.load(store)[0]
    except StoreCorrupt:
        return StoreIndex({}, {})


def replay_all(
    config: EvalConfig, proc, device: str, prompts: Prompts, checked: list[Checked], keep: set, tables
) -> tuple[list[dict], list[dict], list[str]]:
    """Each checkpoint in turn (one in memory at a time) replayed by every process on its part of
    the prompts; the gathers here are evaluation's only collectives. On rank 0: per checkpoint its
    results and the kept prompts' chain rounds by (shard, index), and each process's device."""
    results, kept, where = [], [], []
    for i, x in enumerate(checked):
        m = build(x, *tables, device, config.dtype)
        part = replay_part(m, prompts, prompts.part(proc.rank, proc.world), config, keep, _name(x.path, i))
        del m
        parts = process_group.gather(proc, {**part, "device": device})
        if proc.rank != 0:
            continue
        res, rounds = summarize_parts(parts, config.ddtree, prompts, config.temperature)
        results.append(
            {
                "name": _name(x.path, i),
                "path": x.path,
                "check": x.check,
                "train_shards": x.record.train_shards if x.record else None,
                "step": x.record.step if x.record else None,
                **res,
            }
        )
        kept.append(rounds)
        where = [p["device"] for p in parts]
    return results, kept, where


def _live(
    config: EvalConfig,
    store: HiddenStore,
    prompts: Prompts,
    refs: list,
    checked: list[Checked],
    results: list[dict],
    kept: list[dict],
    tables,
    device: str,
    warnings: list,
) -> None:
    """--live on rank 0 alone: the target, its target-only baseline, then each drafter in turn."""
    from stages.evaluate.live import LiveBench, open_target

    target = open_target(config.target, store.attrs, device, config.allow_mismatch, warnings)
    bench = LiveBench(target, list(prompts.read(refs)), store.attrs)
    for x, res, rounds in zip(checked, results, kept):
        m = build(x, *tables, device, config.dtype)
        res["live"] = bench.run(m, [rounds[r] for r in refs], res["name"])
        del m  # before the next is built


def _served_bench(config: EvalConfig, store: HiddenStore, prompts: Prompts, warnings: list, log):
    from stages.evaluate.served import ServedBench

    target = config.target or store.attrs.target.path
    if not Path(target).is_dir():
        raise TargetError(f"--served: target {target} is not a directory; give the store's target with --target DIR")
    if Path(target).resolve() != Path(store.attrs.target.path).resolve():
        warnings.append(f"--served with --target {target}; the store was made with {store.attrs.target.path}")
    return ServedBench(config.served_python or sys.executable, target, prompts.texts(prompts.refs), store.attrs, log)


def _name(path: str, i: int) -> str:
    p = Path(path).resolve()
    return f"{p.parent.name}/{p.name}" if p.parent.name else f"checkpoint-{i}"
