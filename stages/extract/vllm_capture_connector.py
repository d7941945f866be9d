"""The KV connector that leaves each finished request's tap states in a file, on any device vLLM
runs on. Loaded by vLLM's engine process from vllm_capture_worker.py's directory (its
`kv_connector_module_path`), never imported by dflash-pipeline: stdlib, torch, safetensors and vLLM
only.

Why not vLLM's own `ExampleHiddenStatesConnector`: its write path is CUDA-only. It copies the
states out of the cache on a CUDA stream into pinned memory and tells the scheduler a request is
done when a CUDA event completes; on the CPU platform there is no stream nor event to record (the
engine fails at the first finished request). This subclass keeps everything else of it (the
scheduler side, the lock files, the thread pool that writes the safetensors file, its file format:
"hidden_states" [T, n_taps, H] and "token_ids" [T]) and replaces only that copy: an index into the
host cache, copied at once, so the request is done as soon as its copy exists. On a GPU it copies
the device's slots to the host synchronously, which costs the engine the copy's time (a stream of
its own is what the parent saves there).
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
import vllm_next_token_fix
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

vllm_next_token_fix.apply()  # in every engine process that loads this connector (see that module)


class _Copied:
    """Stands where the parent keeps a CUDA event: the copy it marks is already done."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class HostCopyHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector with the states copied out of the cache synchronously."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + offsets[None, :]).flatten()
        num_tokens = pending.token_ids.shape[0]
        # kv_cache: [num_blocks, n_taps, block_size, H] -> states: [T, n_taps, H], contiguous on the host
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), num_tokens).to("cpu")
        tensors = {"hidden_states": states.contiguous(), "token_ids": pending.token_ids.clone()}
        assert pending.req_id not in self._req_futures, "two writes for one request"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Copied()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
