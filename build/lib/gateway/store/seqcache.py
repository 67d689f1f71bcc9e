"""In-process caches: full token sequences (packed int32, bounded by total tokens) and recent turns.

Full sequences are immutable once a turn is committed, so that cache never needs invalidation.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

from gateway.store.records import Interaction


class SequenceCache:
    """LRU of full sequences by interaction id, bounded by ``max_tokens`` in total."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[str, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, interaction_id: str) -> bool:
        return interaction_id in self._items

    def get(self, interaction_id: str) -> bytes | None:
        packed = self._items.get(interaction_id)
        if packed is None:
            self.misses += 1
            return None
        self.hits += 1
        self._items.move_to_end(interaction_id)
        return packed

    def discard(self, interaction_id: str) -> None:
        packed = self._items.pop(interaction_id, None)
        if packed is not None:
            self.tokens -= len(packed) // 4

    def put(self, interaction_id: str, packed: bytes) -> None:
        size = len(packed) // 4
        if size > self.max_tokens:
            return
        self.discard(interaction_id)
        self._items[interaction_id] = packed
        self.tokens += size
        while self.tokens > self.max_tokens:
            _, evicted = self._items.popitem(last=False)
            self.tokens -= len(evicted) // 4


class TurnCache:
    """In-process LRU of recently recorded or looked-up turns, for ``find_parent``'s Redis path.

    Turns are immutable except ``reward``; a reward set through another replica is not seen here, so
    ``ParentMatch.interaction.reward`` may lag (``get_interaction`` always reads SQL).
    """

    def __init__(self, max_items: int) -> None:
        self.max_items = max_items
        self._items: OrderedDict[str, Interaction] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, interaction_id: str) -> Interaction | None:
        it = self._items.get(interaction_id)
        if it is None:
            return None
        self._items.move_to_end(interaction_id)
        return dataclasses.replace(it)

    def put(self, it: Interaction) -> None:
        if self.max_items <= 0:
            return
        self._items[it.id] = dataclasses.replace(it)
        self._items.move_to_end(it.id)
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)

    def set_reward(self, interaction_id: str, reward: float) -> None:
        it = self._items.get(interaction_id)
        if it is not None:
            it.reward = reward
