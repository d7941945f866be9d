"""Stage one: run the target over the prompt set and write tap-layer hidden states to the store.

`run(config, shard_ids)` writes only the given shards. Each shard is claimed with a lock,
written, and committed by a commit file written last; committed shards are skipped, so a rerun
resumes, and two processes on disjoint ranges fill one store together.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from pipeline import DEFAULT_PROMPTS, TINY_TARGET, fingerprint, prompts as prompt_sets
from pipeline import target as targets
from pipeline.errors import PipelineError
from pipeline.ranges import format_ranges, parse_ranges
from pipeline.taps import parse_taps
from store import layout
from store.hidden_store import HiddenStore
from store.shard_writer import ShardWriter

DEFAULT_NUM_SHARDS = 64
RESPONSES = ("regenerate", "dataset")
_PAUSE_ENV = "DFLASH_TEST_PAUSE_AFTER_BATCHES"  # test hook: after N batches of this run, wait to be killed


@dataclass(frozen=True)
class ExtractConfig:
    store: str = "hs.zarr"
    target: str = str(TINY_TARGET)
    dataset: str = str(DEFAULT_PROMPTS)
    split: str = "train"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    response_field: str = "response"
    responses: str = "regenerate"
    num_shards: int | None = None  # None: the existing store's count, else DEFAULT_NUM_SHARDS
    max_new_tokens: int = 256
    max_length: int = 1024
    batch_size: int = 16
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    dtype: str = "bf16"
    linear_attention: str = "auto"  # auto: fla kernels on CUDA when installed, else the PyTorch fallback
    taps: str | None = None  # "1,16,31" or "n=5"; None: DFlash formula with 5 taps
    mask_token_id: int | None = None  # None: the tokenizer's mask token
    chunk_tokens: int = 256
    shard_tokens: int = 4096
    compression_level: int = 3

    def validate(self) -> None:
        if self.responses not in RESPONSES:
            raise PipelineError(f"--responses {self.responses}: expected one of {', '.join(RESPONSES)}")
        for name in ("max_new_tokens", "max_length", "batch_size", "chunk_tokens", "shard_tokens"):
            if getattr(self, name) < 1:
                raise PipelineError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be at least 1")
        if self.num_shards is not None and self.num_shards < 1:
            raise PipelineError(f"--num-shards {self.num_shards}: must be at least 1")
        if not 0 <= self.compression_level <= 9:
            raise PipelineError(f"--compression-level {self.compression_level}: blosc levels run 0-9")
        if self.shard_tokens % self.chunk_tokens:
            raise PipelineError(f"--shard-tokens {self.shard_tokens} must be a multiple of --chunk-tokens {self.chunk_tokens}")


def resolve_shards(config: ExtractConfig, text: str) -> list[int]:
    """Shard ids from range text, bounded by the store's (or the configured) shard count."""
    config.validate()
    ids = parse_ranges(text, shard_count(config, HiddenStore(config.store)))
    if not ids:
        raise PipelineError(f"--shards {text!r}: no shards selected")
    return ids


def shard_count(config: ExtractConfig, store: HiddenStore) -> int:
    """--num-shards if given (an existing store then checks it matches), else the store's, else 64."""
    return config.num_shards or (store.num_shards if store.exists() else DEFAULT_NUM_SHARDS)


def run(config: ExtractConfig, shard_ids: list[int], log=print) -> dict:
    """Extract the given shards into config.store; returns the run summary."""
    t_start = time.perf_counter()
    config.validate()
    prompt_set = prompt_sets.load(
        config.dataset, prompt_sets.Fields(config.messages_field, config.prompt_field, config.response_field), config.split)
    store = HiddenStore(config.store)
    num_shards = shard_count(config, store)
    if shard_ids and max(shard_ids) >= num_shards:
        raise PipelineError(f"--shards: shard {max(shard_ids)} is out of range for {num_shards} shards")
    target = targets.load(config.target, config.device, config.dtype, config.linear_attention)
    taps = parse_taps(config.taps, target.num_layers)
    mask_id = config.mask_token_id if config.mask_token_id is not None else target.info["mask_token_id"]
    vocab = target.info["vocab_size"]
    if mask_id is None:
        raise PipelineError(f"--target {target.path}: the tokenizer has no mask token; pass --mask-token-id")
    if not 0 <= mask_id < vocab:
        raise PipelineError(f"--mask-token-id {mask_id}: outside the vocabulary (0-{vocab - 1})")
    target.probe()
    backends = target.check_backends()
    attrs = store_attrs(config, target, taps, mask_id, num_shards, prompt_set, backends)
    state = store.create_or_check(attrs, target.model.get_input_embeddings().weight,
                                  target.model.get_output_embeddings().weight)
    log(f"store {config.store}: {state}; target {target.info['model_class']} on {target.device} ({config.dtype}), "
        f"linear attention: {backends['linear_attention']}, attention: {backends['attention']}, taps {taps}")

    done = store.committed()
    todo = [s for s in shard_ids if s not in done]
    locks = claim(store, todo)
    job = Extractor(config, store, target, taps, prompt_set, num_shards)
    job.summary.update(shards_skipped=[s for s in shard_ids if s in done], backends=backends)
    t_loop = time.perf_counter()
    bar = tqdm(total=sum(len(prompt_set.shard_rows(s, num_shards)) for s in todo), unit="sample", desc="extract",
               disable=None, dynamic_ncols=True, file=sys.stderr)
    try:
        for shard in todo:
            record = job.shard(shard, locks[shard], bar)
            locks.pop(shard).release()
            log(f"shard {shard}: {record['samples']} samples, {record['tokens']} tokens, "
                f"skipped {sum(record['skipped'].values())}, {record['wall_s']:.1f}s")
    finally:
        bar.close()
        for lock in locks.values():
            lock.release()
    job.summary["timing"]["loop_s"] = time.perf_counter() - t_loop
    job.summary["wall_s"] = time.perf_counter() - t_start
    return finish_summary(store, job.summary)


def claim(store: HiddenStore, shards: list[int]) -> dict:
    """Lock every shard to write, or none: overlapping ranges with a live process are refused."""
    locks, busy = {}, {}
    for s in shards:
        lock = store.lock(layout.shard_name(s))
        if lock is None:  # object store: no locks, ranges must be disjoint
            locks[s] = _NoLock()
            continue
        owner = lock.try_acquire()
        if owner is None:
            locks[s] = lock
        else:
            busy[s] = owner
    if busy:
        for lock in locks.values():
            lock.release()
        who = ", ".join(sorted({f"{o.get('host')}:{o.get('pid')}" for o in busy.values()}))
        raise PipelineError(f"{store.location}: shards {format_ranges(list(busy))} are being written by {who}; "
                            "overlapping ranges are refused (give each process its own --shards)")
    return locks


class _NoLock:
    def still_held(self) -> bool:
        return True

    def release(self) -> None:
        pass


class Extractor:
    """Writes shards: per batch, prepare prompts, complete them, capture the taps, hand to the writer."""

    def __init__(self, config: ExtractConfig, store: HiddenStore, target: targets.Target, taps: list[int],
                 prompt_set: prompt_sets.PromptSet, num_shards: int) -> None:
        self.config, self.store, self.target, self.taps = config, store, target, taps
        self.prompt_set, self.num_shards = prompt_set, num_shards
        self.pause_after = int(os.environ.get(_PAUSE_ENV, "0"))
        self.summary = {
            "store": config.store, "shards_written": [], "shards_skipped": [], "samples": 0, "tokens": 0,
            "batches": 0, "skipped": {r: 0 for r in layout.SKIP_REASONS}, "truncated": 0,
            "timing": {"prepare_s": 0.0, "generate_s": 0.0, "capture_s": 0.0, "stall_s": 0.0, "writer_busy_s": 0.0},
        }

    def shard(self, shard: int, lock, bar) -> dict:
        t0 = time.perf_counter()
        c = self.config
        writer = ShardWriter(self.store, shard, len(self.taps), self.target.hidden_size, c.chunk_tokens,
                             c.shard_tokens, c.compression_level)
        try:
            rows = list(self.prompt_set.shard_rows(shard, self.num_shards))
            for start in range(0, len(rows), c.batch_size):
                batch = rows[start:start + c.batch_size]
                self.batch(batch, writer)
                bar.update(len(batch))
                elapsed = bar.format_dict["elapsed"] or 1e-9
                bar.set_postfix_str(f"{self.summary['tokens'] / elapsed:.0f} tokens/s, shard {shard}", refresh=False)
                self.summary["batches"] += 1
                if self.pause_after and self.summary["batches"] == self.pause_after:
                    _pause_for_test(writer, shard)
            record = writer.commit(lock, extra={
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
        s["samples"] += record["samples"]
        s["truncated"] += record["truncated"]
        for reason, n in record["skipped"].items():
            s["skipped"][reason] += n
        return record

    def batch(self, rows: list[int], writer: ShardWriter) -> None:
        timing = self.summary["timing"]
        t = time.perf_counter()
        ready = self.prepare(rows, writer)
        timing["prepare_s"] += time.perf_counter() - t
        if not ready:
            return
        t = time.perf_counter()
        completions = self.complete(ready)
        timing["generate_s"] += time.perf_counter() - t
        for (row_id, prompt, _, _), completion in zip(ready, completions):
            ended = bool(completion) and completion[-1] in self.target.eos_ids
            writer.add(row_id, prompt, completion, truncated=not ended)
        t = time.perf_counter()
        hidden = self.target.capture([r[1] + c for r, c in zip(ready, completions)], self.taps)  # [T, n_taps, H] bf16
        timing["capture_s"] += time.perf_counter() - t
        writer.add_hidden(hidden)
        self.summary["tokens"] += len(hidden)

    def prepare(self, rows: list[int], writer: ShardWriter) -> list[tuple[int, list[int], int, str | None]]:
        """(row_id, prompt ids, completion limit, dataset response) for each usable row; skips are counted."""
        c, tok = self.config, self.target.tokenizer
        ready = []
        for i in rows:
            row = self.prompt_set.row(i)
            if not row.messages or not any(str(m["content"]).strip() for m in row.messages):
                writer.skip("empty_prompt")
                continue
            if c.responses == "dataset" and row.response is None:
                writer.skip("missing_response")
                continue
            text = tok.apply_chat_template(list(row.messages), add_generation_prompt=True, tokenize=False)
            prompt = tok(text, add_special_tokens=False).input_ids
            if len(prompt) >= c.max_length:
                writer.skip("prompt_too_long")
                continue
            ready.append((i, prompt, min(c.max_new_tokens, c.max_length - len(prompt)), row.response))
        return ready

    def complete(self, ready) -> list[list[int]]:
        """Greedy completions from the target, or the dataset's own responses (+ EOS), cut to each limit."""
        if self.config.responses == "regenerate":
            return self.target.generate([r[1] for r in ready], [r[2] for r in ready])
        tok, eos = self.target.tokenizer, self.target.eos_ids[0]
        return [(tok(r[3], add_special_tokens=False).input_ids + [eos])[: r[2]] for r in ready]


def _pause_for_test(writer, shard: int) -> None:
    while not writer._queue.empty():
        time.sleep(0.05)
    print(f"DFLASH_TEST_PAUSED shard={shard}", file=sys.stderr, flush=True)
    time.sleep(3600)


def store_attrs(config, target, taps, mask_id, num_shards, prompt_set, backends) -> dict:
    info = target.info
    compat = {
        "schema_version": layout.SCHEMA_VERSION,
        "target_fingerprint": info["fingerprint"],
        "model_class": info["model_class"],
        "tokenizer_sha256": info["tokenizer_sha256"],
        "chat_template_sha256": info["chat_template_sha256"],
        "taps": taps,
        "mask_token_id": mask_id,
        "dataset_sha256": prompt_set.sha256,
        "dataset_rows": len(prompt_set),
        "dataset_fields": prompt_set.describe()["fields"],
        "responses": config.responses,
        "max_new_tokens": config.max_new_tokens,
        "max_length": config.max_length,
        "dtype": config.dtype,
        "device_type": target.device.type,
        "linear_attention": backends["linear_attention"],
        "attention": backends["attention"],
        "num_shards": num_shards,
        "chunk_tokens": config.chunk_tokens,
        "shard_tokens": config.shard_tokens,
        "compression_level": config.compression_level,
    }
    return {
        "kind": "dflash-hidden-states",
        "schema_version": layout.SCHEMA_VERSION,
        "fingerprint": fingerprint.sha256_json(compat),
        "compat": compat,
        "extract": {**asdict(config), "num_shards": num_shards},
        "taps": taps,
        "tap_meaning": "tap k = output of decoder layer k (0-based) = Hugging Face hidden_states[k+1]",
        "num_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "vocab_size": info["vocab_size"],
        "mask_token_id": mask_id,
        "eos_token_ids": info["eos_token_ids"],
        "pad_token_id": info["pad_token_id"],
        "num_shards": num_shards,
        "hidden_dtype": layout.HIDDEN_DTYPE,
        "target": {k: info[k] for k in ("path", "model_class", "model_type", "fingerprint", "config_sha256",
                                        "weights_sha256", "tokenizer_sha256", "chat_template_sha256")},
        "dataset": {**prompt_set.describe(), "split": config.split},
        "backends": backends,
        "device": str(target.device),
        "dtype": config.dtype,
        "layout": {"chunk_tokens": config.chunk_tokens, "shard_tokens": config.shard_tokens,
                   "compressor": layout.compressor(config.compression_level).to_dict()},
        "versions": versions(),
    }


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for pkg in ("torch", "transformers", "flash-linear-attention", "triton", "zarr", "numcodecs", "dflash-pipeline"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def finish_summary(store: HiddenStore, summary: dict) -> dict:
    from store.summary import summarize

    s = summarize(store)
    summary.update({k: s[k] for k in ("bytes_on_disk", "hidden_bytes_on_disk", "hidden_bytes_raw_bf16",
                                      "compression_ratio", "shards_done", "num_shards", "missing")})
    summary["tokens_per_s"] = summary["tokens"] / summary["wall_s"] if summary["wall_s"] else 0.0
    return summary
