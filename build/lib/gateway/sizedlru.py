"""A least-recently-used map bounded by the size of what it holds, not by its number of entries.

The gateway's per-process caches hold the text of conversations in their keys or values (message contents,
rendered prompts). Bounded by entries alone, a few long tool outputs could make one of them hold hundreds of
megabytes, so each entry is counted by its size (characters, in practice), at least ``min_entry`` (the
bookkeeping of a small entry is not free either), and the least recently used entries leave until the total
is back under ``max_size``. Safe to share between the event loop and worker threads (one lock).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, NamedTuple, TypeVar


class CacheSize(NamedTuple):
    """One bounded in-process cache as /metrics shows it: its entries, and how much of its bound it holds
    (``used`` of ``limit``, in the bound's own unit: entries, tokens or characters)."""

    name: str
    entries: int
    used: int
    limit: int


K = TypeVar("K")
V = TypeVar("V")


class SizedLRU(Generic[K, V]):
    """``key -> value``, least recently used out first, holding at most ``max_size`` units."""

    def __init__(self, max_size: int, *, min_entry: int = 1) -> None:
        if max_size < 1 or min_entry < 1:
            raise ValueError(f"max_size and min_entry must be >= 1 (got {max_size}, {min_entry})")
        self.max_size = max_size
        self.min_entry = min_entry
        self.size = 0
        self.hits = 0
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: K) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self.hits += 1
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: K, value: V, size: int) -> None:
        """Keep ``value`` under ``key``, counted as ``size`` units (at least ``min_entry``). An entry larger
        than the whole cache is not kept."""
        size = max(size, self.min_entry)
        if size > self.max_size:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.size -= old[1]
            self._items[key] = (value, size)
            self.size += size
            while self.size > self.max_size:
                _, (_, dropped) = self._items.popitem(last=False)
                self.size -= dropped
