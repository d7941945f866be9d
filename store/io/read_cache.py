"""A reading process's cache of verified chunk bytes, bounded in bytes (least recently used out first).

What a sample read fetches beyond the sample itself is kept here, so that the next read of the same
shard does not fetch it again: a shard file's chunk index (260 bytes), a per-token array's decoded
chunk (tokens and loss mask: 64k tokens each), and the encoded bytes of a state chunk a span used
only in part (its first and last chunk, which the neighbouring samples share). Everything in it
was checked against its checksum on the way in. One cache per store handle (HiddenStore), so a
loader worker's readers share one bound; 0 bytes keeps nothing (every read fetches what it needs).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

DEFAULT_BYTES = 256 << 20


class ReadCache:
    def __init__(self, max_bytes: int = DEFAULT_BYTES) -> None:
        assert max_bytes >= 0, max_bytes
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        """The value kept under key (now the most recently used), or None."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key, value) -> None:
        """Keep value (not None) unless it is larger than the whole bound."""
        n = size_of(value)
        if n > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            self._items[key] = (value, n)
            self.bytes += n
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self._items.popitem(last=False)
                self.bytes -= dropped


def size_of(value) -> int:
    """Bytes a cached value holds: an array's, a few for a marker (a file that does not exist)."""
    return value.nbytes if isinstance(value, np.ndarray) else 64
