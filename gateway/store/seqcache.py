"""In-process LRU of full token sequences (packed int32), bounded by the total number of tokens.

Full sequences are immutable once a turn is committed, so this cache never needs invalidation.
"""

from __future__ import annotations

from collections import OrderedDict


class SequenceCache:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[str, bytes] = OrderedDict()

    def get(self, interaction_id: str) -> bytes | None:
        packed = self._items.get(interaction_id)
        if packed is None:
            self.misses += 1
            return None
        self.hits += 1
        self._items.move_to_end(interaction_id)
        return packed

    def put(self, interaction_id: str, packed: bytes) -> None:
        size = len(packed) // 4
        if size > self.max_tokens:
            return
        old = self._items.pop(interaction_id, None)
        if old is not None:
            self.tokens -= len(old) // 4
        self._items[interaction_id] = packed
        self.tokens += size
        while self.tokens > self.max_tokens:
            _, evicted = self._items.popitem(last=False)
            self.tokens -= len(evicted) // 4
