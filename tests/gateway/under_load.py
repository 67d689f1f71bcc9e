"""Load for the crash and outage tests: agent threads holding multi-turn conversations through a real gateway
process with the real ``openai`` SDK, and the check that everything they were answered is in the store.

``Agents(base_url, sessions).start()`` runs one thread per session. Each conversation grows turn by turn
(the previous answer, then a new user message), so every acknowledged turn has a known parent: the turn
acknowledged before it in the same thread. A 503 is retried with the same messages after its
``Retry-After`` (as an SDK would); any other failure ends the agent (the gateway was killed) or, with
``expect_up=True``, is counted as a failure. :func:`check_recorded` then opens the store and checks every
acknowledged turn: present, in its session, under the right parent, its full token sequence readable, and
no turn recorded twice under one parent (a retried turn that was also committed).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import openai

from gateway.store import Store


@dataclass
class Acked:
    session_id: str
    turn_id: str
    parent_id: str | None


@dataclass
class Agents:
    base_url: str  # the gateway's, without /v1
    sessions: list[dict[str, str]]  # POST /v1/sessions answers (session_id, api_key)
    expect_up: bool = False  # the gateway stays up: anything but 200 / 503 is a failure
    max_tokens: int = 6
    # a conversation starts again (a new root in the same session) after this many turns, so that no
    # conversation outgrows the tiny model's 2,048-token context however long a test's outage lasts and
    # however fast the machine answers (unbounded, a fast run reached 2,049 tokens and got a correct 400)
    max_turns: int = 40
    acked: list[Acked] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)  # 200, 503, 500, ...; 0 = no HTTP answer
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Agents:
        self._threads = [threading.Thread(target=self._run, args=(s,), daemon=True) for s in self.sessions]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)
        assert not any(t.is_alive() for t in self._threads), "an agent did not stop"

    def wait_acked(self, n: int, timeout_s: float = 300) -> None:
        """Wait until ``n`` turns in all were acknowledged (the timeout is a hang guard)."""
        deadline = time.monotonic() + timeout_s
        while len(self.acked) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(self.acked) >= n, f"only {len(self.acked)} turns acknowledged: {self.statuses} {self.failures[:3]}"

    def wait_status(self, status: int, more_than: int, timeout_s: float = 300) -> None:
        """Wait until more than ``more_than`` answers of ``status`` were counted (the timeout is a hang guard)."""
        deadline = time.monotonic() + timeout_s
        while self.statuses[status] <= more_than and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.statuses[status] > more_than, f"no {status} seen: {self.statuses} {self.failures[:3]}"

    def _count(self, status: int, failure: str | None = None) -> None:
        with self._lock:
            self.statuses[status] += 1
            if failure is not None:
                self.failures.append(failure)

    def _run(self, session: dict[str, str]) -> None:
        client = openai.OpenAI(base_url=self.base_url + "/v1", api_key=session["api_key"], max_retries=0,
                               timeout=120)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "q0"}]
        parent: str | None = None
        turn = 0
        while not self._stop.is_set():
            try:
                r = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                                   max_tokens=self.max_tokens)
            except openai.APIStatusError as exc:
                retry = exc.response.headers.get("retry-after")
                if exc.status_code == 503 and retry:
                    self._count(503)
                    time.sleep(min(float(retry), 1.0) / 4)  # the test's outages are short
                    continue  # the same messages again: a retry
                self._count(exc.status_code, f"{exc.status_code} {exc.response.text[:300]}")
                if self.expect_up:
                    continue
                return
            except openai.APIConnectionError as exc:  # the gateway is gone (or, when it should be up, a bug)
                self._count(0, f"no answer: {exc!r}")
                if self.expect_up and not self._stop.is_set():
                    time.sleep(0.2)
                    continue
                return
            self._count(200)
            with self._lock:
                self.acked.append(Acked(session["session_id"], r.id, parent))
            parent = r.id
            turn += 1
            messages = messages + [r.choices[0].message.model_dump(exclude_none=True),
                                   {"role": "user", "content": f"q{turn}"}]
            if turn % self.max_turns == 0:  # a fresh conversation: its first turn is a root
                messages, parent = [{"role": "user", "content": f"q0 of round {turn // self.max_turns}"}], None

    def acked_after(self, mark: int) -> dict[str, int]:
        """Turns acknowledged per session since ``len(acked)`` was ``mark``."""
        return dict(Counter(a.session_id for a in self.acked[mark:]))


def check_recorded(db_url: str, acked: list[Acked]) -> None:
    """Every acknowledged turn is in the store under its parent, readable, and recorded once."""

    async def check() -> None:
        store = await Store.open(db_url, migrate=False)
        try:
            for a in acked:
                turn = await store.get_interaction(interaction_id=a.turn_id)  # NotFound if it was lost
                assert (turn.session_id, turn.parent_id) == (a.session_id, a.parent_id), (a, turn.parent_id)
                full = await store.full_sequence(interaction_id=a.turn_id)
                assert full[len(full) - len(turn.output_ids):] == turn.output_ids
                if a.parent_id is not None:  # the child's tokens start with its parent's, exactly
                    parent = await store.full_sequence(interaction_id=a.parent_id)
                    assert full[:len(parent)] == parent
            for sid in {a.session_id for a in acked}:
                rows = await store.session_interactions(session_id=sid)
                twice = [k for k, n in Counter((r.parent_id, r.request_hash) for r in rows).items() if n > 1]
                assert not twice, f"session {sid}: a turn recorded twice under one parent: {twice}"
        finally:
            await store.close()

    asyncio.run(check())
