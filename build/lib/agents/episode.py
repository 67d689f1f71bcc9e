"""What an example agent returns (`Episode`, `Turn`), and the two callables it is given for rewards.

An agent scores its own answers with a `Scorer` (``await score(completion, reference) -> float``) and
reports each reward to the gateway with a `RewardSink` (``await post(response_id, reward)``). Both are
injected so the same agent runs standalone (``local_scorer``, ``GatewayRewards``), under the runner (a
`RewardPool` behind the scorer) and in tests (a scorer that accepts whatever the model says).

`GatewayRewards` is the whole reward protocol, plain HTTP::

    POST {gateway}/reward   {"response_id": "chatcmpl-...", "reward": 1.0}   (Bearer: the session's key)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from agents.rewards import math_reward

Scorer = Callable[[str, str], Awaitable[float]]
RewardSink = Callable[[str, float], Awaitable[None]]

# A turn counts as correct when its reward reaches this (math_reward gives 1.0 or 0.0).
CORRECT_REWARD = 1.0


async def local_scorer(completion: str, reference: str) -> float:
    """`math_reward` in a thread: fine for one agent; the runner uses a `RewardPool` instead."""
    return await asyncio.to_thread(math_reward, completion, reference)


@dataclass
class Turn:
    """One model call: ``response_id`` is the gateway's interaction id (what rewards are posted against)."""

    response_id: str
    content: str
    finish_reason: str
    tool_calls: int = 0
    reward: float | None = None  # None for turns that were not scored (tool-call turns)

    @property
    def correct(self) -> bool:
        return self.reward is not None and self.reward >= CORRECT_REWARD


@dataclass
class Episode:
    """All turns of one agent run on one sample."""

    turns: list[Turn] = field(default_factory=list)

    @property
    def answers(self) -> list[Turn]:
        """Turns that were scored as answers (every math turn; the tool agent's final turn)."""
        return [t for t in self.turns if t.reward is not None]

    @property
    def correct_first(self) -> bool:
        """The first answer was correct (turn 1 for the math agent)."""
        return bool(self.answers) and self.answers[0].correct

    @property
    def correct_final(self) -> bool:
        return bool(self.answers) and self.answers[-1].correct

    @property
    def reward(self) -> float:
        """The episode's reward: that of its last answer (0.0 if it never answered)."""
        return self.answers[-1].reward if self.answers else 0.0  # type: ignore[return-value]


class GatewayRewards:
    """Post rewards to the gateway's ``POST /reward`` (the one call the OpenAI SDK has no method for)."""

    def __init__(self, gateway_url: str, api_key: str, *, http: httpx.AsyncClient | None = None,
                 retries: int = 3) -> None:
        self.url = gateway_url.rstrip("/") + "/reward"
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self._http = http
        self.retries = retries

    async def __call__(self, response_id: str, reward: float) -> None:
        body = {"response_id": response_id, "reward": reward}
        http = self._http or httpx.AsyncClient(timeout=30.0)
        try:
            for attempt in range(self.retries + 1):
                try:
                    response = await http.post(self.url, json=body, headers=self.headers)
                except httpx.TransportError:
                    if attempt == self.retries:
                        raise
                    await asyncio.sleep(0.5 * 2**attempt)
                    continue
                if response.status_code in (429, 502, 503, 504) and attempt < self.retries:
                    await asyncio.sleep(_retry_after(response, 0.5 * 2**attempt))
                    continue
                response.raise_for_status()
                return
        finally:
            if self._http is None:
                await http.aclose()


def _retry_after(response: httpx.Response, fallback: float) -> float:
    try:
        return max(0.0, float(response.headers.get("retry-after", fallback)))
    except ValueError:
        return fallback
