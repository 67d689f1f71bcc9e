"""The trainer's step reports as the gateway received them (``POST /admin/trainer`` with ``metrics``).

The trainer posts its version after every step (admission control); since the trace viewer it may add the
step's metrics (``reward/mean``, ``logprob_gap/mean``, ...). The last ``max_entries`` reports are kept for
the viewer's trainer page: in Redis when the gateway has it (a list shared by replicas, so whichever replica
serves the page shows every report), else in this process.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from typing import Any

from redis.exceptions import RedisError

from gateway.errors import StoreUnavailable

MAX_KEYS = 64
MAX_KEY_LEN = 64


def clean_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a report (at most ``MAX_KEYS`` names of at most ``MAX_KEY_LEN`` characters)."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if len(out) >= MAX_KEYS:
            break
        if isinstance(value, bool) or not isinstance(value, (int, float)) or len(name) > MAX_KEY_LEN:
            continue
        if math.isfinite(float(value)):
            out[name] = float(value)
    return out


class TrainerLog:
    """Bounded log of ``{"at", "version", "metrics"}`` entries, oldest first."""

    def __init__(self, redis: Any | None = None, *, prefix: str = "agentrl:", max_entries: int = 2000) -> None:
        self.redis = redis
        self.key = f"{prefix}trainer:log"
        self.max_entries = max_entries
        self._local: deque[dict[str, Any]] = deque(maxlen=max_entries)

    async def add(self, *, version: int, metrics: dict[str, Any]) -> None:
        entry = {"at": time.time(), "version": int(version), "metrics": clean_metrics(metrics)}
        if self.redis is None:
            self._local.append(entry)
            return
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.rpush(self.key, json.dumps(entry))
                pipe.ltrim(self.key, -self.max_entries, -1)
                await pipe.execute()
        except RedisError as exc:
            raise StoreUnavailable(f"Redis failed: {exc}") from exc

    async def entries(self) -> list[dict[str, Any]]:
        if self.redis is None:
            return list(self._local)
        try:
            raw = await self.redis.lrange(self.key, 0, -1)
        except RedisError as exc:
            raise StoreUnavailable(f"Redis failed: {exc}") from exc
        return [json.loads(item) for item in raw]

