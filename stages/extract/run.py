"""Stage one: run the target over the prompt set and write tap-layer hidden states to the store.

`run(config)` writes only the shards of `config.shards`. Each shard is claimed with a lease (a lock
file, or an object on S3: store/store_writer.py), written, and committed by a commit file written
last; committed shards are skipped, so a rerun resumes. Any number of processes fill one store
together, a launcher's ranks (torchrun, `accelerate launch`, srun) or separate commands with
overlapping ranges alike: a shard's lease decides who writes it, and no process waits for another
(but for the one creating the store).
"""

from __future__ import annotations

import math
import os
import time

from tqdm import tqdm

from pipeline import device as devices
from pipeline import prompts as prompt_sets
from pipeline import server_gpus
from pipeline.errors import DatasetError
from pipeline.reference_server import ReferenceServer
from pipeline.target import loading
from pipeline.target.model import Target
from pipeline.target.taps import parse_taps
from stages.extract import disk_space, engine_capture, reference_cost
from stages.extract.config import ExtractConfig, default_num_shards
from stages.extract.engine_capture import VllmCapture
from stages.extract.extractor import Extractor
from stages.extract.provenance import store_attrs
from stages.extract.summary import finish_summary, nothing_stored
from store import index_file
from store.errors import ConfigError, StoreError
from store.format import layout
from store.format.ranges import parse_ranges
from store.format.schema import StoreAttrs
from store.hidden_store import HiddenStore
from store.store_writer import StoreWriter
from store.verify import verify

INTERRUPTED = (
    "interrupted: committed shards are kept, the shard in progress is left uncommitted; "
    "rerun the same command to resume"
)


def resolve_shards(config: ExtractConfig, store: HiddenStore, rows: int) -> tuple[list[int], int]:
    """(shard ids of --shards, the store's shard count): --num-shards if given (an existing store
    then checks it matches), else the store's, else the default for a dataset of `rows` rows."""
    num_shards = config.num_shards or (store.num_shards if store.exists() else default_num_shards(rows))
    ids = parse_ranges(config.shards, num_shards)
    if not ids:
        raise ConfigError("--shards", repr(config.shards), "no shards selected")
    return ids, num_shards


def run(config: ExtractConfig, log=print) -> dict:
    """Extract config.shards into config.store; returns the run summary. Under a launcher each
    process claims the shards it writes as it goes (see `shard_order`)."""
    t_start = time.perf_counter()
    process = devices.Process.from_env()
    say = (lambda m: log(process.label() + m)) if process.world > 1 else log
    store = StoreWriter(config.store, config.lease_s)
    store.check_reachable()  # an object store: before the dataset and the target load
    store.check_leases()  # S3: its conditional writes honoured, or one line before anything is written
    prompt_set = prompt_sets.load(
        config.dataset,
        prompt_sets.Fields(
            config.messages_field,
            config.prompt_field,
            config.response_field,
            config.template_kwargs_field,
            config.category_field,
        ),
        config.split,
    )
    shard_ids, num_shards = resolve_shards(config, store, len(prompt_set))
    check_rows(prompt_set, shard_ids, num_shards)
    cost = reference_cost.notice(config)
    if cost and process.rank == 0:
        say(cost)
    engine = connect(config, say)
    version = engine_capture.check_python(config.capture_python) if config.capture == "vllm" else None
    capturer = None
    try:
        target, taps, attrs, capturer = open_target(config, process, prompt_set, num_shards, engine, version, say)
        done, damaged = store.commits()
        damaged = {s: e for s, e in damaged.items() if s in shard_ids}
        if damaged and not config.redo:
            raise next(iter(damaged.values()))
        need = disk_space.needed(
            config,
            store,
            target,
            attrs,
            prompt_set,
            {s: prompt_set.shard_rows(s, num_shards) for s in shard_ids if s not in done},
            done,
        )
        disk_space.check(store, need, config.ignore_free_space, say)
        with disk_space.stop_when_full(store, need):
            state = store.create_or_check(
                attrs,
                target.model.get_input_embeddings().weight,
                target.model.get_output_embeddings().weight,
                repair=config.redo,
            )
            say(
                f"store {config.store}: {state}; target {target.record.model_class} on {target.device} "
                f"({config.dtype}), linear attention: {attrs.backends.linear_attention}, attention: "
                f"{attrs.backends.attention}, taps {taps}"
            )
            if config.redo:
                redone = redo_corrupt(store, [s for s in shard_ids if s in done or s in damaged], say)
                done = {s: r for s, r in done.items() if s not in redone}
            todo = shard_order(store, [s for s in shard_ids if s not in done], process)
            job = Extractor(config, store, target, taps, prompt_set, num_shards, engine, capturer)
            job.summary.update(shards_skipped=[s for s in shard_ids if s in done], backends=attrs.backends)
            t_loop = time.perf_counter()
            job.write(todo, process.label(), say)
    finally:
        if engine is not None:
            engine.close()
        if capturer is not None:
            capturer.close()
    job.summary["timing"]["loop_s"] = time.perf_counter() - t_loop
    if engine is not None:
        job.summary["server"] = server_use(engine, job.summary["timing"])
    if capturer is not None:
        job.summary["capture_engine"] = capturer.seconds
    job.summary["wall_s"] = time.perf_counter() - t_start
    job.summary["process"] = {"rank": process.rank, "world": process.world}
    summary = finish_summary(store, job.summary)
    if summary["shards_done"] == summary["num_shards"]:  # complete: training's first launch reads one index file
        summary["index"] = saved_index(store)
    check_stored(config, store, summary, shard_ids, prompt_set, num_shards)
    return summary


def check_stored(
    config: ExtractConfig,
    store: HiddenStore,
    summary: dict,
    shard_ids: list[int],
    prompt_set: prompt_sets.PromptSet,
    num_shards: int,
) -> None:
    """A run that wrote shards of --shards, all of them now committed without a sample, fails
    naming why (the skip counts of their commit files): it would otherwise end well and leave
    training to fail on an empty store. Its shards stay committed, as any others. Judged over all
    of --shards, so a rerun that writes nothing never fails, nor does a process of a launcher
    whose share was empty while another's held samples; the last process to finish sees every
    shard committed and reports it."""
    if not summary["shards_written"] or summary["samples"]:
        return
    records = store.commits()[0]
    if any(s not in records for s in shard_ids) or any(records[s].samples for s in shard_ids):
        return  # another process is still at one of them, or they hold samples
    skipped: dict[str, int] = {}
    for s in shard_ids:
        for reason, n in records[s].skipped.items():
            skipped[reason] = skipped.get(reason, 0) + n
    rows = sum(len(prompt_set.shard_rows(s, num_shards)) for s in shard_ids)
    raise DatasetError(nothing_stored(config, shard_ids, rows, len(prompt_set), skipped))


def saved_index(store: HiddenStore) -> str:
    """Build and save the index file of the store's commits (store/index_file.py); what happened."""
    try:
        return index_file.load(store)[1]
    except StoreError as e:  # another process's damaged shard: training names it when it reads it
        return f"sample index not built ({e})"


def server_use(engine: ReferenceServer, timing: dict) -> dict:
    """How the run used the reference server, and the --concurrency that would have kept the target
    busy: requests in flight = a request's latency x the rate the loop takes references at when it
    does not wait (Little's law)."""
    waited, loop = timing["generate_s"], timing["loop_s"]
    mean = engine.request_s / engine.requests if engine.requests else 0.0
    rate = engine.requests / (loop - waited) if loop > waited else 0.0
    return {
        "requests": engine.requests,
        "mean_request_s": round(mean, 3),
        "concurrency": engine.concurrency,
        "waited_s": round(waited, 2),
        "loop_s": round(loop, 2),
        "needed_in_flight": math.ceil(mean * rate),
    }


def redo_corrupt(store: StoreWriter, shards: list[int], say) -> list[int]:
    """--redo: each committed shard checked under its lock (every byte); a corrupt one is deleted, so
    this run writes it again. Returns the deleted shards."""
    deleted = []
    for shard in tqdm(shards, desc="verify", unit="shard", disable=None):
        lock = store.lock(layout.shard_name(shard))
        if lock is not None and lock.try_acquire() is not None:
            continue  # another process is at it
        try:
            problems = verify(store, [shard]).problems.get(shard)
            if problems:
                say(f"shard {shard} is corrupt ({problems[0]}): deleted, to be extracted again")
                store.clear_shard(shard)
                deleted.append(shard)
        finally:
            if lock is not None:
                lock.release()
    return deleted


def check_rows(prompt_set: prompt_sets.PromptSet, shard_ids: list[int], num_shards: int) -> None:
    """Every row of this run's shards parsed now: a bad row in the last shard fails in seconds,
    before any model loads; so does a dataset without rows."""
    if not len(prompt_set):
        raise DatasetError(
            f"dataset {prompt_set.source}: no rows (an empty file, or a filter or split that left "
            "none); nothing to extract"
        )
    for shard in shard_ids:
        prompt_set.check(prompt_set.shard_rows(shard, num_shards))


def connect(config: ExtractConfig, say) -> ReferenceServer | None:
    """The reference server of --responses server, checked before the target loads (a wrong URL or
    model fails in seconds)."""
    if config.responses != "server":
        return None
    engine = ReferenceServer(
        config.server_url, config.server_model, config.concurrency, config.server_timeout_s, sampling=config.sampling()
    )
    say(f"references from {engine.connect().identity} at {engine.info.url}")
    return engine


def engine_beside(url: str, device: str) -> None:
    """Before the target loads: one line if the reference server runs on this host on the GPU the
    target would load on (pipeline/server_gpus.py). Nothing to check off CUDA."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return
    props = torch.cuda.get_device_properties(dev)
    server_gpus.check(url, str(props.uuid), f"GPU {dev.index or 0} ({props.name})")


def open_target(
    config: ExtractConfig,
    process: devices.Process,
    prompt_set: prompt_sets.PromptSet,
    num_shards: int,
    engine: ReferenceServer | None,
    vllm_version: str | None,
    say,
) -> tuple[Target, list[int], StoreAttrs, VllmCapture | None]:
    """The target on this process's device, its taps and mask token checked, the kernels probed,
    with --capture vllm the engine started (it also generates the references; the target here has no
    weights), and the store attributes this run writes or must match."""
    device = process.device(config.device)
    if engine is not None:
        engine_beside(config.server_url, device)
    here = vllm_version is None  # forwards in this process; with an engine it also makes the references
    target = loading.load(config.target, device, config.dtype, config.linear_attention, with_weights=here)
    if engine is not None:
        engine.check_vocabulary(target.tokenizer)
    taps = parse_taps(config.taps, target.num_layers)
    mask_id = config.mask_token_id if config.mask_token_id is not None else target.tokenizer.mask_token_id
    if mask_id is None:
        raise ConfigError("--mask-token-id", None, f"the tokenizer of {target.path} has no mask token; pass one")
    if not 0 <= mask_id < target.vocab_size:
        raise ConfigError("--mask-token-id", mask_id, f"outside the vocabulary (0-{target.vocab_size - 1})")
    if here:
        target.probe()
        backends = target.check_backends()
    if vllm_version is None:
        attrs = store_attrs(config, target, taps, mask_id, num_shards, prompt_set, backends, engine and engine.info)
        return target, taps, attrs, None
    capturer = start_capture(config, target, taps, vllm_version, str(device), process.world, say)
    backends = engine_capture.backends(config.linear_attention)
    attrs = store_attrs(
        config, target, taps, mask_id, num_shards, prompt_set, backends, engine and engine.info, capturer.record
    )
    return target, taps, attrs, capturer


def start_capture(
    config: ExtractConfig, target: Target, taps: list[int], version: str, device: str, world: int, say
) -> VllmCapture:
    """--capture vllm: the engine up with the taps' layer ids, on this process's share of the node's GPUs
    under a launcher (`engine_capture.engine_env`), or one line (it is stopped again)."""
    import torch

    engine_capture.check_split(target.model.config, config.capture_tp)
    gpus = torch.cuda.device_count() if device.startswith("cuda") else 0
    say(
        f"starting vLLM {version} ({config.capture_python}) to capture taps {taps} of {config.target}, "
        f"tensor parallel {config.capture_tp}, pipeline parallel {config.capture_pp}, "
        f"quantization {config.capture_quantization or 'as the checkpoint has it'}"
    )
    capturer = VllmCapture(
        config.capture_python,
        config.target,
        taps,
        target.hidden_size,
        config.dtype,
        config.max_length + 1,  # the prefill of a whole sequence, and the one token vLLM makes after it
        config.capture_memory,
        version,
        tensor_parallel=config.capture_tp,
        pipeline_parallel=config.capture_pp,
        quantization=config.capture_quantization,
        env=engine_capture.engine_env(dict(os.environ), device, world, config.capture_tp * config.capture_pp, gpus),
    )
    try:
        return capturer.start()
    except BaseException:
        capturer.close()
        raise


def shard_order(store: StoreWriter, shards: list[int], process: devices.Process) -> list[int]:
    """The shards this process tries, in order. With leases (a POSIX file system, S3) every process
    tries every shard, each starting at its own share, and a shard's lease decides who writes it: a
    fast process takes more, and a rerun with any number of processes resumes. Without (other
    object stores) each process takes a fixed, disjoint share."""
    if not store.leased:
        return shards[process.rank :: process.world]
    start = process.rank * len(shards) // process.world
    return shards[start:] + shards[:start]
