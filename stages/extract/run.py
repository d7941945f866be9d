"""Stage one: run the target over the prompt set and write tap-layer hidden states to the store.

`run(config)` writes only the shards of `config.shards`. Each shard is claimed with a lock,
written, and committed by a commit file written last; committed shards are skipped, so a rerun
resumes. Any number of processes fill one store together, a launcher's ranks (torchrun,
`accelerate launch`, srun) or separate commands with overlapping ranges alike: a shard's lock
decides who writes it, and no process waits for another.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NamedTuple

import torch
from tqdm import tqdm

from pipeline import device as devices
from pipeline import prompts as prompt_sets
from pipeline import turns
from pipeline.engine import Engine
from pipeline.errors import DatasetError, TargetError
from pipeline.target import loading
from pipeline.target.model import Target
from pipeline.target.taps import parse_taps
from stages.extract import space
from stages.extract.config import ExtractConfig, default_num_shards
from stages.extract.provenance import store_attrs
from stages.extract.summary import finish_summary
from store import layout
from store.errors import ConfigError
from store.hidden_store import HiddenStore
from store.locks import LockFile
from store.ranges import parse_ranges
from store.schema import ShardCommit, StoreAttrs, completion_limit
from store.shard_writer import ShardWriter
from store.verify import verify

INTERRUPTED = ("interrupted: committed shards are kept, the shard in progress is left uncommitted; "
               "rerun the same command to resume")


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
    store = HiddenStore(config.store)
    prompt_set = prompt_sets.load(config.dataset, prompt_sets.Fields(config.messages_field, config.prompt_field,
                                                                     config.response_field), config.split)
    shard_ids, num_shards = resolve_shards(config, store, len(prompt_set))
    check_rows(prompt_set, shard_ids, num_shards)
    engine = connect(config, say)
    try:
        target, taps, attrs = open_target(config, process, prompt_set, num_shards, engine)
        done, damaged = store.commits()
        damaged = {s: e for s, e in damaged.items() if s in shard_ids}
        if damaged and not config.redo:
            raise next(iter(damaged.values()))
        need = space.needed(config, store, target, attrs, prompt_set,
                            {s: prompt_set.shard_rows(s, num_shards) for s in shard_ids if s not in done}, done)
        space.check(store, need, config.ignore_free_space, say)
        with space.stop_when_full(store, need):
            state = store.create_or_check(attrs, target.model.get_input_embeddings().weight,
                                          target.model.get_output_embeddings().weight, repair=config.redo)
            say(f"store {config.store}: {state}; target {target.record.model_class} on {target.device} "
                f"({config.dtype}), linear attention: {attrs.backends.linear_attention}, attention: "
                f"{attrs.backends.attention}, taps {taps}")
            if config.redo:
                redone = redo_corrupt(store, [s for s in shard_ids if s in done or s in damaged], say)
                done = {s: r for s, r in done.items() if s not in redone}
            todo = shard_order(store, [s for s in shard_ids if s not in done], process)
            job = Extractor(config, store, target, taps, prompt_set, num_shards, engine)
            job.summary.update(shards_skipped=[s for s in shard_ids if s in done], backends=attrs.backends)
            t_loop = time.perf_counter()
            write_shards(store, todo, job, {s: len(prompt_set.shard_rows(s, num_shards)) for s in todo}, process, say)
    finally:
        if engine is not None:
            engine.close()
    job.summary["timing"]["loop_s"] = time.perf_counter() - t_loop
    job.summary["wall_s"] = time.perf_counter() - t_start
    job.summary["process"] = {"rank": process.rank, "world": process.world}
    return finish_summary(store, job.summary)


def redo_corrupt(store: HiddenStore, shards: list[int], say) -> list[int]:
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
    before any model loads."""
    for shard in shard_ids:
        prompt_set.check(prompt_set.shard_rows(shard, num_shards))


def connect(config: ExtractConfig, say) -> Engine | None:
    """The reference server of --responses server, checked before the target loads (a wrong URL or
    model fails in seconds)."""
    if config.responses != "server":
        return None
    engine = Engine(config.server_url, config.server_model, config.concurrency, config.server_timeout_s)
    say(f"references from {engine.connect().identity} at {engine.info.url}")
    return engine


def open_target(config: ExtractConfig, process: devices.Process, prompt_set: prompt_sets.PromptSet,
                num_shards: int, engine: Engine | None) -> tuple[Target, list[int], StoreAttrs]:
    """The target on this process's device, its taps and mask token checked, the kernels probed,
    and the store attributes this run writes or must match."""
    target = loading.load(config.target, process.device(config.device), config.dtype, config.linear_attention)
    if engine is not None:
        engine.check_vocabulary(target.tokenizer)
    taps = parse_taps(config.taps, target.num_layers)
    mask_id = config.mask_token_id if config.mask_token_id is not None else target.tokenizer.mask_token_id
    if mask_id is None:
        raise ConfigError("--mask-token-id", None, f"the tokenizer of {target.path} has no mask token; pass one")
    if not 0 <= mask_id < target.vocab_size:
        raise ConfigError("--mask-token-id", mask_id, f"outside the vocabulary (0-{target.vocab_size - 1})")
    target.probe()
    backends = target.check_backends()
    attrs = store_attrs(config, target, taps, mask_id, num_shards, prompt_set, backends, engine and engine.info)
    return target, taps, attrs


def write_shards(store: HiddenStore, todo: list[int], job: Extractor, rows: dict[int, int],
                 process: devices.Process, say) -> None:
    """Claim and write each shard of todo in turn, one progress bar over their rows."""
    with tqdm(total=sum(rows.values()), unit="sample", desc=f"{process.label()}extract", disable=None,
              dynamic_ncols=True, file=sys.stderr) as bar:
        for shard in todo:
            record = claim_and_write(store, shard, job, bar)
            if record is None:
                bar.total -= rows[shard]
                continue
            say(f"shard {shard}: {record.samples} samples, {record.tokens} tokens, "
                f"skipped {sum(record.skipped.values())}, {record.run['wall_s']:.1f}s")


def shard_order(store: HiddenStore, shards: list[int], process: devices.Process) -> list[int]:
    """The shards this process tries, in order. With locks (a POSIX file system) every process
    tries every shard, each starting at its own share, and a shard's lock decides who writes it: a
    fast process takes more, and a rerun with any number of processes resumes. Without locks
    (object stores) each process takes a fixed, disjoint share."""
    if not store.local:
        return shards[process.rank::process.world]
    start = process.rank * len(shards) // process.world
    return shards[start:] + shards[:start]


def claim_and_write(store: HiddenStore, shard: int, job: Extractor, bar) -> ShardCommit | None:
    """Write shard under its lock; None when another live process holds it or it was committed
    since this run looked (the commit file is read again once the lock is ours)."""
    lock = store.lock(layout.shard_name(shard))
    holder = lock.try_acquire() if lock is not None else None
    if holder is not None:
        job.summary["shards_left"][shard] = f"{holder.get('host')}:{holder.get('pid')}"
        return None
    try:
        if store.commit_record(shard) is not None:
            job.summary["shards_skipped"].append(shard)
            return None
        return job.shard(shard, lock, bar)
    finally:
        if lock is not None:
            lock.release()


class Prepared(NamedTuple):
    """A usable row, rendered: its prompt ids, its completion limit, and with --turns all the spans
    of its earlier assistant answers inside the prompt."""

    row_id: int
    prompt: list[int]
    limit: int
    row: prompt_sets.Row
    answers: tuple[tuple[int, int], ...] = ()


@dataclass
class Batch:
    """One batch on its way: the rows, the usable ones prepared, and their completions (lists, or
    futures from the server)."""

    rows: list[int]
    ready: list[Prepared]
    completions: list


class Extractor:
    """Writes shards: per batch, prepare prompts, complete them, capture the taps, hand to the writer.
    With a server, the completions of the next batches are in flight while one is captured."""

    def __init__(self, config: ExtractConfig, store: HiddenStore, target: Target, taps: list[int],
                 prompt_set: prompt_sets.PromptSet, num_shards: int, engine: Engine | None = None) -> None:
        self.config, self.store, self.target, self.taps = config, store, target, taps
        self.prompt_set, self.num_shards, self.engine = prompt_set, num_shards, engine
        self.ahead = 0 if engine is None else -(-config.concurrency // config.batch_size)  # batches in flight
        self.summary = {
            "store": config.store, "shards_written": [], "shards_skipped": [], "shards_left": {}, "samples": 0,
            "tokens": 0, "records": [],
            "batches": 0, "skipped": {r: 0 for r in layout.SKIP_REASONS}, "truncated": 0,
            "timing": {"prepare_s": 0.0, "generate_s": 0.0, "capture_s": 0.0, "stall_s": 0.0, "writer_busy_s": 0.0},
        }

    def shard(self, shard: int, lock: LockFile | None, bar) -> ShardCommit:
        t0 = time.perf_counter()
        c = self.config
        writer = ShardWriter(self.store, shard, len(self.taps), self.target.hidden_size, c.chunk_tokens,
                             c.shard_tokens, c.codec, c.compression_level, max_held_bytes=int(c.writer_memory_gb * 2**30),
                             threads=c.writer_threads)
        try:
            rows = self.prompt_set.by_length(self.prompt_set.shard_rows(shard, self.num_shards))
            in_flight: deque[Batch] = deque()
            for start in range(0, len(rows), c.batch_size):
                in_flight.append(self.start(rows[start:start + c.batch_size], writer))
                if len(in_flight) > self.ahead:
                    self.finish(in_flight.popleft(), writer, bar, shard)
            while in_flight:
                self.finish(in_flight.popleft(), writer, bar, shard)
            record = writer.commit(lock, run={
                "wall_s": time.perf_counter() - t0, "host": os.uname().nodename, "pid": os.getpid(),
                "batch_size": c.batch_size, "device": str(self.target.device),
                "backends": self.target.check_backends(), "committed_at": time.time()})
        except BaseException:
            writer.abort()
            raise
        s, timing = self.summary, self.summary["timing"]
        timing["stall_s"] += writer.stall_s
        timing["writer_busy_s"] += writer.busy_s
        s["shards_written"].append(shard)
        s["records"].append(record)
        s["samples"] += record.samples
        s["truncated"] += record.truncated
        for reason, n in record.skipped.items():
            s["skipped"][reason] += n
        return record

    def start(self, rows: list[int], writer: ShardWriter) -> Batch:
        """Prepare a batch and complete it, or send it to the server (then its completions are futures)."""
        timing = self.summary["timing"]
        t = time.perf_counter()
        ready = self.prepare(rows, writer)
        timing["prepare_s"] += time.perf_counter() - t
        if self.engine is not None:
            eos = self.target.eos_ids
            return Batch(rows, ready, [self.engine.submit(r.prompt, r.limit, eos) for r in ready])
        t = time.perf_counter()
        completions = self.complete(ready) if ready else []
        timing["generate_s"] += time.perf_counter() - t
        return Batch(rows, ready, completions)

    def finish(self, batch: Batch, writer: ShardWriter, bar, shard: int) -> None:
        """Wait for the batch's completions, record them, capture the taps, hand them to the writer."""
        timing = self.summary["timing"]
        t = time.perf_counter()
        completions = [c.result() if isinstance(c, Future) else c for c in batch.completions]
        timing["generate_s"] += time.perf_counter() - t
        ready = []
        for r, completion in zip(batch.ready, completions):
            if completion is None:  # the server rejected it
                writer.skip("server_rejected")
                continue
            ready.append((r, completion))
        if ready:
            t = time.perf_counter()
            seqs = [r.prompt + c for r, c in ready]
            if self.config.agreement:
                hidden, agreement = self.target.capture(seqs, self.taps, [len(r.prompt) for r, _ in ready])
            else:
                hidden, agreement = self.target.capture(seqs, self.taps), None  # [T, n_taps, H] bf16
            timing["capture_s"] += time.perf_counter() - t
            kept, hidden = self.finite(ready, hidden, writer, shard)
            if agreement is not None and len(kept) == len(ready):  # a batch with a row left out: not counted
                writer.agree(*agreement)
            for r, completion in kept:
                ended = bool(completion) and completion[-1] in self.target.eos_ids
                writer.add(r.row_id, r.prompt, completion, truncated=not ended, answers=r.answers)
            if kept:
                writer.add_hidden(hidden)
            self.summary["tokens"] += len(hidden)
        self.summary["batches"] += 1
        bar.update(len(batch.rows))
        elapsed = bar.format_dict["elapsed"] or 1e-9
        bar.set_postfix_str(f"{self.summary['tokens'] / elapsed:.0f} tokens/s, shard {shard}", refresh=False)

    def finite(self, ready: list, hidden: torch.Tensor, writer: ShardWriter, shard: int) -> tuple[list, torch.Tensor]:
        """The batch's rows whose states are all finite, and their states. hidden: [T, n_taps, H],
        the rows of `ready` (prepared, completion) back to back. A row with NaN or Inf stops the run
        naming it, or with --skip-nonfinite is left out and counted. NaN and Inf carry through a
        sum, so one sum per batch clears it (a reduction: 16 ms for 420 MB of bf16 on 2 CPU cores,
        where isfinite().all() takes 0.8 s); only a sum that is not finite (or overflowed) has
        each row checked element by element."""
        if bool(torch.isfinite(hidden.sum())):
            return ready, hidden
        parts = hidden.split([len(r.prompt) + len(c) for r, c in ready])
        bad = [i for i, part in enumerate(parts) if not bool(torch.isfinite(part).all())]
        if not bad:
            return ready, hidden
        rows = ", ".join(str(ready[i][0].row_id) for i in bad)
        if not self.config.skip_nonfinite:
            raise TargetError(f"{self.store.location}: shard {shard}: the target's hidden states hold NaN or Inf for "
                              f"dataset row(s) {rows}; the shard is not committed (pass --skip-nonfinite to leave such "
                              "rows out and count them)")
        for _ in bad:
            writer.skip("nonfinite")
        keep = [i for i in range(len(ready)) if i not in bad]
        return [ready[i] for i in keep], torch.cat([parts[i] for i in keep]) if keep else hidden[:0]

    def prepare(self, rows: list[int], writer: ShardWriter) -> list[Prepared]:
        """Each usable row rendered; skips are counted."""
        c, tok = self.config, self.target.tokenizer
        ready = []
        for i in rows:
            row = self.prompt_set.row(i)
            if not row.messages or not any(str(m["content"]).strip() for m in row.messages):
                writer.skip("empty_prompt")
                continue
            if c.responses == "dataset" and row.response is None and row.response_ids is None:
                writer.skip("missing_response")
                continue
            prompt = turns.render(tok, row.messages, generation_prompt=True)
            if len(prompt) >= c.max_length:
                writer.skip("prompt_too_long")
                continue
            answers = () if c.turns == "last" else tuple(turns.answer_spans(
                tok, row.messages, prompt, self.target.eos_ids, f"dataset {self.prompt_set.source}: row {i}"))
            ready.append(Prepared(i, prompt, completion_limit(c.max_new_tokens, c.max_length, len(prompt)), row, answers))
        return ready

    def complete(self, ready) -> list[list[int]]:
        """Greedy completions from the target, or the dataset's own responses cut to each limit: its
        token ids verbatim when it has them, else its text tokenized, plus EOS."""
        if self.config.responses == "regenerate":
            return self.target.generate([r.prompt for r in ready], [r.limit for r in ready])
        return [self.dataset_response(r.row, r.limit) for r in ready]

    def dataset_response(self, row, limit: int) -> list[int]:
        if row.response_ids is not None:
            bad = [t for t in row.response_ids if t >= self.target.vocab_size]
            if bad:
                raise DatasetError(f"dataset {self.prompt_set.source}: row {row.index} response ids hold {bad[0]}, "
                                   f"outside the target's vocabulary (0-{self.target.vocab_size - 1})")
            return list(row.response_ids[:limit])
        tok, eos = self.target.tokenizer, self.target.eos_ids[0]
        return (tok(row.response, add_special_tokens=False).input_ids + [eos])[:limit]
