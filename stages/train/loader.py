"""The loader: a rank's batches read and padded by --workers DataLoader worker processes running
the dataset (dataset.py), in order, the workers kept for the whole run; a sample whose read failed
stops the run or is left out (--on-corrupt); the shared memory the workers hand batches over in,
checked up front."""

from __future__ import annotations

import logging
import math
import os
import shutil
from collections.abc import Iterable

import torch

from stages.train.config import DataConfig
from stages.train.dataset import StoreBatches
from stages.train.epoch_order import Row
from stages.train.samples import Refs
from store.errors import ConfigError, StoreCorrupt
from store.hidden_store import HiddenStore
from store.io.node_cache import NodeCache

PREFETCH = 4  # batches each loader worker keeps ready (in shared memory until the trainer takes them)
SHM = "/dev/shm"  # where DataLoader workers hand batches over (Linux)


def loader(
    config: DataConfig,
    batches: Iterable[list[Row]],
    pin: bool,
    skipped: set,
    warn=None,
    *,
    store: HiddenStore,
    node_cache: NodeCache | None,
    final_state: bool = False,
):
    """Batches read and padded by --workers worker processes, in order. `batches` may be endless
    (every epoch's, formed as they are reached): its batches go to the workers as they are taken,
    and the workers live as long as this loader. A sample whose read failed (damaged or missing)
    stops the run (--on-corrupt stop: one line naming the file and the fix) or is left out of its
    batch and added to `skipped` (skip). A node cache that cannot be written is said once (to warn).
    store: the process's open store, opened with node_cache (the run's: stages/train/setup.py),
    read through with --workers 0; each worker opens its own (dataset.py). final_state: the batches carry
    the final states too (--soft-targets)."""
    dataset = StoreBatches(store, node_cache=node_cache, final_state=final_state)
    workers = torch.utils.data.DataLoader(
        dataset,
        sampler=batches,
        batch_size=None,
        num_workers=config.workers,
        pin_memory=pin,
        prefetch_factor=PREFETCH if config.workers else None,
        worker_init_fn=quiet_inherited_sessions,
    )
    said = False
    for batch in workers:
        if batch.cache_trouble and warn is not None and not said:
            warn(f"warning: {batch.cache_trouble}")
            said = True
        for shard, index, why in batch.corrupt:
            if config.on_corrupt == "stop":
                raise StoreCorrupt(why)
            skipped.add((shard, index))
        yield batch


def quiet_inherited_sessions(_worker: int) -> None:
    """In a forked loader worker: do not report the parent's HTTP sessions as unclosed. An object
    store's file system (s3fs) holds an aiohttp session bound to the parent's event loop; the fork
    copies it, nothing here can close it (the parent does, at its exit), and when the worker's
    garbage collector frees the copy aiohttp printed "Unclosed client session" at every loader
    start. The worker's own sessions end with the process."""
    logging.getLogger("asyncio").addFilter(
        lambda r: not str(r.msg).startswith(("Unclosed client session", "Unclosed connector"))
    )


def shared_memory_need(config: DataConfig, refs: Refs, n_taps: int, hidden_size: int, local_processes: int) -> int:
    """Bytes of shared memory the loader workers of one node's `local_processes` training
    processes may hold at once: each worker's PREFETCH batches of bf16 states, rows as long as
    the longest sample (packed rows: --max-length)."""
    if not config.workers or not refs:
        return 0
    row = config.max_length if config.batching == "packed" else int(refs.length.max())
    batch = config.batch_size * row * n_taps * hidden_size * 2  # hidden: [b, T, n_taps, H] bf16
    return local_processes * config.workers * PREFETCH * batch


def check_shared_memory(config: DataConfig, need: int, path: str = SHM) -> None:
    """Refuse up front, in one line, a run whose loader workers would run out of shared memory at
    the first batches (a container's default /dev/shm is 64 MB); no check where there is none."""
    if not need or not os.path.isdir(path):
        return
    free = shutil.disk_usage(path).free
    if need > free:
        gib = math.ceil(need / 2**30)
        raise ConfigError(
            "--workers",
            config.workers,
            f"the loader workers on this node may hold {need / 2**30:.1f} GiB of batches in {path}, "
            f"which has {free / 2**30:.1f} GiB free; give it more (docker run --shm-size={gib + 1}g, "
            "or a larger tmpfs) or use --workers 0 (read in the training process)",
        )
