"""Outages of the trainer's peers (the gateway, the engines) are waited out, not fatal.

A chaos run (issue 36, ``bench/chaos.py``) saw 47 trainer restarts in 10 minutes: every lease, ack,
registration or weight push that met a gateway replica or an engine that was down ended ``agentrl train``
with status 1. Nothing was lost (the lease is re-delivered, a failed push is rolled back), but training
stopped unless a supervisor restarted it, and every restart reloaded the model and the checkpoint.

Now each such call goes through :class:`OutageRetry`: a *transient* failure (a connection error or timeout,
an answer 502/503/504) is retried with a bounded exponential back-off (1 s doubling to 30 s), logged once
when the outage starts and once when it ends (with its length and the number of attempts); if the peer is
still gone after ``--outage-give-up-s`` (default 1800 s) the trainer stops with a :class:`PeerOutage` that
says what was unreachable and for how long. Anything else (a 401, a 400, a refused weight shape) is not an
outage and is raised at once, as before.

In a multi-rank run the call sites are either rank 0 only (leases, acks, registration) or collective (the
weight push, whose error every rank raises identically): for those, rank 0 decides whether to retry or give
up and broadcasts the decision, so that every rank retries the same number of times.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

from trainer.data import GatewayError

log = logging.getLogger("trainer")

T = TypeVar("T")

#: what a peer that is down, restarting or overloaded looks like in the errors of trainer.data and
#: trainer.weight_sync (both keep the transport error's repr or the answer's status in their message)
_TRANSIENT = re.compile(
    r"ConnectError|ConnectTimeout|ReadTimeout|WriteTimeout|PoolTimeout|ReadError|WriteError|RemoteProtocolError|"
    r"Connection refused|Connection reset|Server disconnected|answered 50[234]\b")


class PeerOutage(GatewayError):
    """A peer stayed unreachable longer than ``--outage-give-up-s``: the trainer gives up (``agentrl train``
    prints it and exits 1, as for any GatewayError)."""


def is_transient(exc: BaseException) -> bool:
    """A connection error or timeout, or an answer 502/503/504 (anywhere in the exception's chain)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, httpx.TransportError):
            return True
        if _TRANSIENT.search(str(cur)):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


class OutageRetry:
    """Retry a call while its peer is down: bounded back-off, one log line per outage, a clear give-up."""

    def __init__(self, give_up_s: float, *, first_s: float = 1.0, max_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.give_up_s = give_up_s
        self.first_s, self.max_s = first_s, max_s
        self.clock, self.sleep = clock, sleep
        self.outages = 0  # outages seen (each logged once)
        self.retries = 0  # failed attempts retried, over all outages

    def call(self, what: str, fn: Callable[[], T], *, errors: tuple[type[BaseException], ...],
             info: Any = None) -> T:
        """``fn()``, retried while it raises a transient error of ``errors``. ``info`` (a DistInfo) makes
        the decision rank 0's, broadcast to every rank (for collective calls); None: this process decides."""
        since: float | None = None
        attempts = 0
        delay = self.first_s
        while True:
            try:
                result = fn()
            except errors as exc:
                attempts += 1
                now = self.clock()
                if since is None:
                    since = now
                verdict = self._verdict(exc, what, since, now, attempts)
                if info is not None:
                    from trainer.weight_sync import broadcast_object

                    verdict = broadcast_object(verdict, info)
                if verdict == "raise":
                    raise
                if verdict != "retry":
                    raise PeerOutage(verdict) from exc
                self.retries += 1
                self.sleep(delay)
                delay = min(delay * 2, self.max_s)
                continue
            if since is not None and (info is None or getattr(info, "is_main", True)):
                log.warning("%s: the outage is over after %.1f s and %d failed attempt(s); training goes on",
                            what, self.clock() - since, attempts)
            return result

    def _verdict(self, exc: BaseException, what: str, since: float, now: float, attempts: int) -> str:
        """"retry", "raise" (not an outage), or the give-up message."""
        if not is_transient(exc):
            return "raise"
        if attempts == 1:
            self.outages += 1
            log.warning("%s: peer unavailable (%s); waiting for it: retrying with back-off up to %.0f s, "
                        "giving up after %.0f s (--outage-give-up-s)", what, _short(exc), self.max_s, self.give_up_s)
        if now - since >= self.give_up_s:
            return (f"{what}: gave up after {now - since:.0f} s and {attempts} attempts "
                    f"(--outage-give-up-s {self.give_up_s:g}); the last error: {_short(exc)}")
        return "retry"


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= 300 else text[:297] + "..."
