"""What one process works out and every process of the run then uses: the main process decides,
the others wait for its answer (or its error) instead of each doing the same work."""

from __future__ import annotations

import torch

from store.errors import UserError


def on_main(acc, fn):
    """fn() run on the main process alone, its result given to every process (picklable). An error
    there is raised on every process: the main process's own, one line of it elsewhere."""
    if acc.num_processes == 1:
        return fn()
    box, error = [None, None], None
    if acc.is_main_process:
        try:
            box[0] = fn()
        except Exception as e:  # noqa: BLE001 - handed to the other processes, then raised here
            error = e
            box[1] = (isinstance(e, UserError), str(e) or type(e).__name__)
    torch.distributed.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[1] is not None:
        user, text = box[1]
        raise (UserError if user else RuntimeError)(text)
    return box[0]


def gather(acc, value) -> list:
    """Every process's value (picklable), in rank order, on every process."""
    if acc.num_processes == 1:
        return [value]
    out = [None] * acc.num_processes
    torch.distributed.all_gather_object(out, value)
    return out
