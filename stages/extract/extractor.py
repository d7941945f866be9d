"""Writing shards: each batch's prompts prepared, completed (by the target, the dataset, or a
server: --responses), its tap states captured and handed to the shard's writer, each shard claimed
under its lock and committed when its last batch is written."""

from __future__ import annotations

import os
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pipeline import chat_template, turns
from pipeline import prompts as prompt_sets
from pipeline.chat_template import Chat
from pipeline.errors import DatasetError, TargetError
from pipeline.reference_server import ReferenceServer
from pipeline.sampling import row_seed
from pipeline.target import final_state
from pipeline.target.model import Target
from stages.extract.config import ExtractConfig
from stages.extract.engine_capture import VllmCapture
from stages.extract.progress import Progress
from store.format import layout
from store.format.schema import ShardCommit, completion_limit
from store.io.locks import LockFile
from store.shard_writer import ShardWriter
from store.store_writer import StoreWriter

TOKEN_ROWS = "token ids (no template)"  # rows given as ids, not rendered: their mode in the summary's count


class Prepared(NamedTuple):
    """A usable row, rendered: its prompt ids, its completion limit, and with --turns all the spans
    of its earlier assistant answers inside the prompt."""

    row_id: int
    prompt: list[int]
    limit: int
    row: prompt_sets.Row
    answers: tuple[tuple[int, int], ...] = ()
    chat: Chat | None = None  # how the row renders (its template arguments)


@dataclass
class OpenShard:
    """A claimed shard being written: its lock, its writer, the batches not yet finished."""

    shard: int
    lock: LockFile | None
    t0: float
    writer: ShardWriter | None = None
    left: int = 0

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


@dataclass
class Batch:
    """One batch on its way: the rows, the usable ones prepared, and their completions (lists, or
    futures from the server)."""

    rows: list[prompt_sets.Row]
    ready: list[Prepared]
    completions: list


class Extractor:
    """Writes shards: per batch, prepare prompts, complete them, capture the taps, hand to the writer.
    With a server, the completions of the next batches (of this shard or the next) are in flight
    while one is captured."""

    def __init__(
        self,
        config: ExtractConfig,
        store: StoreWriter,
        target: Target,
        taps: list[int],
        prompt_set: prompt_sets.PromptSet,
        num_shards: int,
        engine: ReferenceServer | None = None,
        capturer: VllmCapture | None = None,
    ) -> None:
        """capturer: what captures the taps instead of the target (--capture vllm)."""
        self.config, self.store, self.target, self.taps = config, store, target, taps
        self.capturer = capturer or target
        self.format = store.layout.format  # the store's, as created or opened (store/format/hidden_formats.py)
        self.final = store.layout.final_state  # the store's: keep and check the final state (--final-state)
        self._head_gain = None  # (lm_head [V, H] bf16 on the target's device, final-norm gain [H] fp32)
        self.prompt_set, self.num_shards, self.engine = prompt_set, num_shards, engine
        self.ahead = 0 if engine is None else -(-config.concurrency // config.batch_size)  # batches in flight
        self.summary = {
            "store": config.store,
            "shards_written": [],
            "shards_skipped": [],
            "shards_left": {},
            "samples": 0,
            "tokens": 0,
            "records": [],
            "batches": 0,
            "skipped": {r: 0 for r in layout.SKIP_REASONS},
            "truncated": 0,
            "template_modes": Counter(),
            "timing": {"prepare_s": 0.0, "generate_s": 0.0, "capture_s": 0.0, "stall_s": 0.0, "writer_busy_s": 0.0},
        }

    def write(self, todo: list[int], label: str, say) -> None:
        """Claim and write each shard of todo in turn, one progress report over their rows. The batches
        of all of them pass through one queue: with a server, the next shard's first requests are in
        flight while this shard's last batches are captured, so the target never waits at a shard's
        end. A shard is committed as soon as its last batch is written."""
        rows = {s: len(self.prompt_set.shard_rows(s, self.num_shards)) for s in todo}
        open_shards: list[OpenShard] = []
        with Progress(sum(rows.values()), label, say) as self.progress:
            try:
                in_flight: deque[tuple[OpenShard, Batch]] = deque()
                for job, batch_rows in self.batches(todo, rows, open_shards, say):
                    in_flight.append((job, self.start(batch_rows, job.writer)))
                    if len(in_flight) > self.ahead:
                        self.finish_next(in_flight, open_shards, say)
                while in_flight:
                    self.finish_next(in_flight, open_shards, say)
            except BaseException:
                for job in open_shards:  # left uncommitted: a rerun writes them again
                    job.writer.abort()
                    job.release()
                raise

    def batches(self, todo: list[int], rows: dict[int, int], open_shards: list, say):
        """(shard, rows of a batch) of every shard this process claims, claimed only when its first
        batch is wanted."""
        size = self.config.batch_size
        for shard in todo:
            job = self.claim(shard)
            if job is None:
                self.progress.drop(rows[shard])
                continue
            open_shards.append(job)
            ordered = self.prompt_set.by_length(self.prompt_set.shard_rows(shard, self.num_shards))
            job.left = -(-len(ordered) // size)
            if not job.left:
                self.commit(job, open_shards, say)
            for start in range(0, len(ordered), size):
                yield job, ordered[start : start + size]

    def claim(self, shard: int) -> OpenShard | None:
        """The shard under its lock, with its writer; None when another live process holds it or it
        was committed since this run looked (the commit file is read again once the lock is ours)."""
        lock = self.store.lock(layout.shard_name(shard))
        holder = lock.try_acquire() if lock is not None else None
        if holder is not None:
            self.summary["shards_left"][shard] = f"{holder.get('host')}:{holder.get('pid')}"
            return None
        job = OpenShard(shard, lock, time.perf_counter())
        try:
            if self.store.commit_record(shard) is not None:
                self.summary["shards_skipped"].append(shard)
                job.release()
                return None
            c = self.config
            job.writer = ShardWriter(
                self.store,
                shard,
                len(self.taps),
                self.target.hidden_size,
                c.chunk_tokens,
                c.shard_tokens,
                c.compression_level,
                max_held_bytes=int(c.writer_memory_gb * 2**30),
                threads=c.writer_threads,
            )
        except BaseException:
            job.release()
            raise
        return job

    def finish_next(self, in_flight: deque, open_shards: list, say) -> None:
        job, batch = in_flight.popleft()
        self.finish(batch, job.writer, job.shard)
        job.left -= 1
        if not job.left:
            self.commit(job, open_shards, say)

    def commit(self, job: OpenShard, open_shards: list, say) -> ShardCommit:
        c, writer = self.config, job.writer
        if self.final and writer.stats.final_state is not None:
            final_state.require(
                writer.stats.final_state, f"{self.store.location}: shard {job.shard}", self.store.attrs.compat
            )
        record = writer.commit(
            job.lock,
            run={
                "wall_s": time.perf_counter() - job.t0,
                "host": os.uname().nodename,
                "pid": os.getpid(),
                "batch_size": c.batch_size,
                "capture_tokens": c.capture_tokens,
                "device": str(self.target.device),
                # of the target loaded here (with an engine: generate's; none without its weights)
                "backends": None if self.target.device.type == "meta" else self.target.check_backends(),
                **({} if self.capturer is self.target else {"capture": self.capturer.record}),
                "committed_at": time.time(),
            },
        )
        open_shards.remove(job)
        job.release()
        s, timing = self.summary, self.summary["timing"]
        timing["stall_s"] += writer.stall_s
        timing["writer_busy_s"] += writer.busy_s
        s["shards_written"].append(job.shard)
        s["records"].append(record)
        s["samples"] += record.samples
        s["truncated"] += record.truncated
        for reason, n in record.skipped.items():
            s["skipped"][reason] += n
        say(
            f"shard {job.shard}: {record.samples} samples, {record.tokens} tokens, "
            f"skipped {sum(record.skipped.values())}, {record.run['wall_s']:.1f}s"
        )
        return record

    def start(self, rows: list[prompt_sets.Row], writer: ShardWriter) -> Batch:
        """Prepare a batch and complete it, or send it to the server (then its completions are futures)."""
        timing = self.summary["timing"]
        t = time.perf_counter()
        ready = self.prepare(rows, writer)
        timing["prepare_s"] += time.perf_counter() - t
        if self.engine is not None:
            eos = self.target.eos_ids
            return Batch(rows, ready, [self.engine.submit(r.prompt, r.limit, eos, r.row_id) for r in ready])
        t = time.perf_counter()
        completions = self.complete(ready, writer.shard) if ready else []
        timing["generate_s"] += time.perf_counter() - t
        return Batch(rows, ready, completions)

    def finish(self, batch: Batch, writer: ShardWriter, shard: int) -> None:
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
            rounding, budget = self.format.rounding, self.config.capture_tokens
            final, agreement = None, None
            if self.final:  # the agreement is the stored final state's (below)
                hidden, final = self.capturer.capture(
                    seqs, self.taps, rounding=rounding, budget=budget, final_state=True
                )  # [T, n_taps, H], [T, H] bf16
            elif self.config.agreement:
                hidden, agreement = self.capturer.capture(
                    seqs, self.taps, [len(r.prompt) for r, _ in ready], rounding=rounding, budget=budget
                )
            else:
                hidden = self.capturer.capture(seqs, self.taps, rounding=rounding, budget=budget)  # [T, n_taps, H] bf16
            timing["capture_s"] += time.perf_counter() - t
            kept, hidden, final = self.finite(ready, hidden, final, writer, shard)
            if final is not None and kept:
                checked = self.check_final(kept, final)
                writer.check_final(checked)
                agreement = (checked["matches"], checked["tokens"]) if len(kept) == len(ready) else None
            if agreement is not None and len(kept) == len(ready):  # a batch with a row left out: not counted
                writer.agree(*agreement)
            for r, completion in kept:
                ended = bool(completion) and completion[-1] in self.target.eos_ids
                writer.add(
                    r.row_id, r.prompt, completion, truncated=not ended, answers=r.answers, category=r.row.category
                )
            if kept:
                writer.add_hidden(hidden, final)
            self.summary["tokens"] += len(hidden)
        self.summary["batches"] += 1
        self.progress.done(len(batch.rows), self.summary["tokens"], shard)

    def check_final(self, kept: list, final: torch.Tensor) -> dict:
        """The batch's final states ([T, H] bf16, the rows of `kept` back to back) checked against the
        target's lm_head and final-norm gain, exactly as they are stored (pipeline/target/final_state.py)."""
        if self._head_gain is None:
            self._head_gain = (
                self.target.model.get_output_embeddings().weight.detach().to(torch.bfloat16),
                self.target.final_norm_gain(),
            )
        tokens = torch.tensor([t for r, c in kept for t in r.prompt + c], dtype=torch.long)
        lengths = [len(r.prompt) + len(c) for r, c in kept]
        return final_state.check_batch(final, tokens, lengths, [len(r.prompt) for r, _ in kept], *self._head_gain)

    def finite(
        self, ready: list, hidden: torch.Tensor, final: torch.Tensor | None, writer: ShardWriter, shard: int
    ) -> tuple[list, torch.Tensor, torch.Tensor | None]:
        """The batch's rows whose states (and final states, when kept) are all finite, and their states.
        hidden: [T, n_taps, H], final: [T, H] or None, the rows of `ready` (prepared, completion) back to
        back. A row with NaN or Inf stops the run naming it, or with --skip-nonfinite is left out and
        counted. NaN and Inf carry through a sum, so one sum per batch clears it (a reduction: 16 ms for
        420 MB of bf16 on 2 CPU cores, where isfinite().all() takes 0.8 s); only a sum that is not finite
        (or overflowed) has each row checked element by element."""
        states = [hidden] if final is None else [hidden, final]
        if all(bool(torch.isfinite(x.sum())) for x in states):
            return ready, hidden, final
        lengths = [len(r.prompt) + len(c) for r, c in ready]
        parts = [x.split(lengths) for x in states]  # per state array, per row
        bad = [i for i in range(len(ready)) if not all(bool(torch.isfinite(p[i]).all()) for p in parts)]
        if not bad:
            return ready, hidden, final
        rows = ", ".join(str(ready[i][0].row_id) for i in bad)
        if not self.config.skip_nonfinite:
            raise TargetError(
                f"{self.store.location}: shard {shard}: the target's hidden states hold NaN or Inf for "
                f"dataset row(s) {rows}; the shard is not committed (pass --skip-nonfinite to leave such "
                "rows out and count them)"
            )
        for _ in bad:
            writer.skip("nonfinite")
        keep = [i for i in range(len(ready)) if i not in bad]
        kept = [torch.cat([p[i] for i in keep]) if keep else x[:0] for p, x in zip(parts, states)]
        return [ready[i] for i in keep], kept[0], kept[1] if final is not None else None

    def prepare(self, rows: list[prompt_sets.Row], writer: ShardWriter) -> list[Prepared]:
        """Each usable sample rendered: a row's, or with --turns split one per assistant turn;
        skips are counted (per sample)."""
        c, ready = self.config, []
        for row in rows:
            chat = chat_template.for_row(self.target.tokenizer, row, c.template_args(), self.prompt_set.source)
            self.summary["template_modes"][
                chat_template.mode(chat.kwargs) if row.prompt_ids is None else TOKEN_ROWS
            ] += 1
            for sample in row.per_turn() if c.turns == "split" else [row]:
                prepared = self.prepared(sample, chat, writer)
                if prepared is not None:
                    ready.append(prepared)
        return ready

    def prepared(self, row: prompt_sets.Row, chat: Chat, writer: ShardWriter) -> Prepared | None:
        c = self.config
        if not prompt_sets.has_prompt(row):
            writer.skip("empty_prompt")
            return None
        if c.responses == "dataset" and not prompt_sets.has_response(row):  # none, or blank
            writer.skip("missing_response")
            return None
        if row.prompt_ids is not None:  # a token row, as given: no template; the loss runs inside it as given
            prompt, answers = self.in_vocabulary(list(row.prompt_ids), row, "prompt"), row.prompt_spans
        else:
            chat_template.check(chat, row.conversation())
            prompt = chat.ids(row.messages, generation_prompt=True)
            answers = (
                tuple(turns.answer_spans(chat, row.messages, prompt, self.target.eos_ids)) if c.turns == "all" else ()
            )
        if len(prompt) >= c.max_length:
            writer.skip("prompt_too_long")
            return None
        return Prepared(
            row.index, prompt, completion_limit(c.max_new_tokens, c.max_length, len(prompt)), row, answers, chat
        )

    def in_vocabulary(self, ids: list[int], row: prompt_sets.Row, what: str) -> list[int]:
        """ids, refused naming the row when one lies outside the target's vocabulary."""
        bad = [t for t in ids if t >= self.target.vocab_size]
        if bad:
            raise DatasetError(
                f"dataset {self.prompt_set.source}: row {row.index} {what} ids hold {bad[0]}, "
                f"outside the target's vocabulary (0-{self.target.vocab_size - 1})"
            )
        return ids

    def complete(self, ready, shard: int) -> list[list[int]]:
        """Greedy (or with --temperature sampled, each row with its own seed) completions from the
        target (its progress reported token by token) or from the --capture vllm engine (the one that
        captures: the target is loaded once), or the dataset's own responses cut to each limit: its
        token ids verbatim when it has them, else its text tokenized, plus EOS."""
        sampling = self.config.sampling()
        seeds = None if sampling is None else [row_seed(sampling.seed, r.row_id) for r in ready]
        if self.config.responses == "regenerate" and self.capturer is not self.target:  # --capture vllm
            prompts, limits = [r.prompt for r in ready], [r.limit for r in ready]
            return self.capturer.generate(prompts, limits, self.target.eos_ids)  # greedy: the config refuses sampling
        if self.config.responses == "regenerate":
            limit = max(r.limit for r in ready)
            return self.target.generate(
                [r.prompt for r in ready],
                [r.limit for r in ready],
                lambda k: self.progress.generating(shard, k, limit, len(ready)),
                sampling,
                seeds,
            )
        return [self.dataset_response(r.row, r.limit, r.chat) for r in ready]

    def dataset_response(self, row: prompt_sets.Row, limit: int, chat: Chat) -> list[int]:
        if row.response_ids is not None:
            return self.in_vocabulary(list(row.response_ids), row, "response")[:limit]
        answer = row.answer or {"role": "assistant", "content": row.response}
        return chat_template.answer_ids(chat, row.messages, answer, self.target.eos_ids)[:limit]
