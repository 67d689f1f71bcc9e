"""The agent runner: drive a dataset through the gateway with an example agent, and summarise.

For every prompt it creates ``group_size`` sessions sharing one group id (a GRPO group), runs the agent in
each (at most ``concurrency`` at a time), scores answers in a `RewardPool`, posts the rewards, finishes the
sessions, and returns a summary: accuracy of the first answer and of the last, mean reward, reward-pool
troubles and how often it had to back off.

    from agents.runner import RunnerSettings, run_agents
    summary = asyncio.run(run_agents(RunnerSettings(gateway="http://127.0.0.1:8000", admin_key="k",
                                                    dataset="synthetic:1", limit=8, group_size=4)))

The gateway may be briefly down (connection refused, 502/503/504) or refuse new sessions with 429 while
the trainer is behind (the staleness budget): both are retried with exponential backoff, honouring
``Retry-After``, for up to ``gateway_wait_s`` / ``admission_wait_s``; the progress bar shows the counts.
When the gateway stays down, `GatewayUnavailable` ends the run. An episode whose model call fails for
good (e.g. a 400) is counted as failed, its session is finished, and the run goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urljoin

import httpx
import httpx2
import openai
from openai import AsyncOpenAI
from tqdm import tqdm

from agents.datasets import Sample, load_dataset
from agents.episode import Episode
from agents.math_agent import run_math_agent
from agents.rewards import RewardFn, RewardPool, math_reward
from agents.settings import AGENTS, DEFAULT_MAX_TURNS, RunnerSettings  # noqa: F401  (re-exported)
from agents.tool_agent import Tool, run_tool_agent

log = logging.getLogger(__name__)

class GatewayError(RuntimeError):
    """The gateway refused a request for good (4xx other than 429); the message holds its error body."""


class GatewayUnavailable(GatewayError):
    """The gateway stayed down, or kept refusing sessions with 429, for longer than we wait."""


@dataclass
class Counters:
    backoffs_429: int = 0  # session creations/rewards refused with 429 and retried after Retry-After
    gateway_retries: int = 0  # requests retried because the gateway was down or answered 502/503/504
    model_call_retries: int = 0  # model calls answered 429/5xx (the openai SDK retries those itself)


@dataclass(frozen=True)
class Session:
    id: str
    api_key: str
    base_url: str


class Gateway:
    """The gateway's session and reward API (plain HTTP, admin key), with backoff and retry counters."""

    def __init__(self, settings: RunnerSettings, http: httpx.AsyncClient, counters: Counters) -> None:
        self.url = settings.gateway
        self.admin_headers = {"Authorization": f"Bearer {settings.admin_key}"}
        self.http = http
        self.counters = counters
        self.down_wait_s = settings.gateway_wait_s
        self.admission_wait_s = settings.admission_wait_s

    async def request(self, method: str, path: str, *, json: Any = None,
                      headers: dict[str, str] | None = None) -> httpx.Response:
        started = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            backoff = min(10.0, 0.25 * 2 ** min(attempt, 10)) * (0.75 + 0.5 * random.random())
            try:
                response = await self.http.request(method, self.url + path, json=json,
                                                   headers=headers or self.admin_headers)
            except httpx.TransportError as exc:
                problem, limit = f"{type(exc).__name__}: {exc}", self.down_wait_s
                self.counters.gateway_retries += 1
            else:
                if response.status_code < 400:
                    return response
                if response.status_code == 429:
                    problem, limit = "429 " + _error_message(response), self.admission_wait_s
                    self.counters.backoffs_429 += 1
                    backoff = _retry_after(response, backoff)
                elif response.status_code in (502, 503, 504):
                    problem, limit = f"{response.status_code} {_error_message(response)}", self.down_wait_s
                    self.counters.gateway_retries += 1
                else:
                    raise GatewayError(f"{method} {path} -> {response.status_code}: {_error_message(response)}")
            waited = time.monotonic() - started
            if waited + backoff > limit:
                raise GatewayUnavailable(f"{method} {self.url}{path}: still failing after {waited:.0f}s "
                                         f"({attempt} attempts): {problem}")
            log.debug("%s %s: %s; retrying in %.1fs", method, path, problem, backoff)
            await asyncio.sleep(backoff)

    async def create_session(self, *, group_id: str, task_id: str, metadata: dict[str, Any]) -> Session:
        body = (await self.request("POST", "/v1/sessions",
                                   json={"group_id": group_id, "task_id": task_id, "metadata": metadata})).json()
        # base_url may be absolute or relative to the gateway
        return Session(body["session_id"], body["api_key"], urljoin(self.url + "/", body["base_url"]))

    async def finish(self, session_id: str) -> None:
        await self.request("POST", f"/v1/sessions/{session_id}/finish")

    async def post_reward(self, response_id: str, reward: float, api_key: str) -> None:
        await self.request("POST", "/reward", json={"response_id": response_id, "reward": reward},
                           headers={"Authorization": f"Bearer {api_key}"})


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
        return str(body["error"]["message"]) if isinstance(body.get("error"), dict) else str(body)
    except (ValueError, KeyError, AttributeError):
        return response.text[:300]


def _retry_after(response: httpx.Response, fallback: float) -> float:
    try:
        value = float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return fallback
    return value if math.isfinite(value) and value >= 0 else fallback


@dataclass(frozen=True)
class EpisodeRecord:
    """One finished session, handed to ``run_agents(on_episode=...)``; ``episode`` is None if it failed."""

    sample: Sample
    session_id: str
    group_id: str
    episode: Episode | None


@dataclass
class Tally:
    """Running results, for the progress bar and the summary."""

    episodes: list[Episode] = field(default_factory=list)
    failed: int = 0

    def postfix(self, counters: Counters) -> dict[str, Any]:
        n = len(self.episodes)
        return {
            "reward": f"{sum(e.reward for e in self.episodes) / n:.3f}" if n else "-",
            "acc1": f"{sum(e.correct_first for e in self.episodes) / n:.2f}" if n else "-",
            "acc": f"{sum(e.correct_final for e in self.episodes) / n:.2f}" if n else "-",
            "429": counters.backoffs_429,
            "retry": counters.gateway_retries + counters.model_call_retries,
            "failed": self.failed,
        }


async def run_agents(settings: RunnerSettings, *, samples: Sequence[Sample] | None = None,
                     reward_fn: RewardFn = math_reward, tools: Sequence[Tool] = (),
                     on_episode: Callable[[EpisodeRecord], None] | None = None,
                     reward_pool: RewardPool | None = None) -> dict[str, Any]:
    """Run ``settings.agent`` over the dataset (or ``samples``) through the gateway; return the summary.

    ``reward_fn(completion, reference) -> float`` runs in a `RewardPool`; it must be a module-level
    function (workers import it by name). ``tools`` are extra tools for the tools agent. ``on_episode`` is
    called after each session is finished (for logs, or to look the session up in the gateway). Pass a
    ``reward_pool`` to keep its warm workers across several calls (it is then not closed here, and its
    ``stats`` accumulate; the summary reports this call's share).
    """
    settings.validate()  # idempotent; fills derived values (max_turns) for settings built in code
    if samples is None:
        samples = load_dataset(settings.dataset, split=settings.split, limit=settings.limit,
                               seed=settings.seed, offset=settings.offset)
    samples = list(samples)[: settings.limit]
    counters = Counters()
    tally = Tally()
    started = time.monotonic()

    async def count_model_retries(response: httpx2.Response) -> None:
        if response.status_code == 429 or response.status_code >= 500:
            counters.model_call_retries += 1

    pool = reward_pool or RewardPool(workers=settings.reward_workers, timeout_s=settings.reward_timeout_s,
                                     retries=settings.reward_retries)
    stats_before = dataclasses.replace(pool.stats)
    admin_http = httpx.AsyncClient(timeout=60.0)
    # one connection pool for every session's OpenAI client
    sdk_http = httpx2.AsyncClient(timeout=settings.request_timeout_s,
                                  limits=httpx2.Limits(max_connections=settings.concurrency + 4),
                                  event_hooks={"response": [count_model_retries]})
    gateway = Gateway(settings, admin_http, counters)
    bar = tqdm(total=len(samples) * settings.group_size, desc="eval" if settings.eval else settings.agent,
               unit="episode", disable=not settings.progress, dynamic_ncols=True)
    agent_slots = asyncio.Semaphore(settings.concurrency)
    # Sessions of a group are created together (a group is ready only when all its sessions finish), and
    # only as many groups are open as the agent slots can run, so open sessions track running agents.
    group_slots = asyncio.Semaphore(max(1, math.ceil(settings.concurrency / settings.group_size)))
    model_name = settings.model
    model_lock = asyncio.Lock()
    run_tag = uuid.uuid4().hex[:8]

    async def resolve_model(client: AsyncOpenAI) -> str:
        nonlocal model_name
        async with model_lock:
            if not model_name:
                models = await client.models.list()
                if not models.data:
                    raise GatewayError("GET /v1/models returned no model; pass --model")
                model_name = models.data[0].id
        return model_name

    async def run_episode(sample: Sample, session: Session, group_id: str) -> None:
        async with agent_slots:
            client = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, http_client=sdk_http,
                                 max_retries=5, timeout=settings.request_timeout_s)

            async def score(completion: str, reference: str) -> float:
                return await pool.score(reward_fn, completion, reference)

            async def post(response_id: str, reward: float) -> None:
                await gateway.post_reward(response_id, reward, session.api_key)

            episode: Episode | None = None
            try:
                common = dict(model=await resolve_model(client), max_turns=settings.max_turns,
                              temperature=settings.temperature, max_tokens=settings.max_tokens,
                              score=score, rewards=post)
                if settings.agent == "math":
                    episode = await run_math_agent(client, sample, **common)
                else:
                    episode = await run_tool_agent(client, sample, tools=tools, **common)
            except GatewayUnavailable:
                raise  # ends the run; finishing would only wait for the same dead gateway
            except (openai.APIError, GatewayError) as exc:
                log.warning("episode of %s in session %s failed: %s", sample.id, session.id, exc)
            try:
                await gateway.finish(session.id)
            except GatewayUnavailable:
                raise
            except GatewayError as exc:
                log.warning("could not finish session %s: %s", session.id, exc)
            if episode is None:
                tally.failed += 1
            else:
                tally.episodes.append(episode)
            if on_episode is not None:
                on_episode(EpisodeRecord(sample, session.id, group_id, episode))
            bar.update(1)
            bar.set_postfix(tally.postfix(counters), refresh=False)

    async def run_group(sample: Sample) -> None:
        async with group_slots:
            group_id = f"{sample.id}-{run_tag}"
            # group_size tells the gateway when this GRPO group is complete (ready for training)
            metadata = {"eval": settings.eval, "group_size": settings.group_size, "agent": settings.agent,
                        "dataset": settings.dataset}
            sessions = [await gateway.create_session(group_id=group_id, task_id=sample.id, metadata=metadata)
                        for _ in range(settings.group_size)]
            async with asyncio.TaskGroup() as group:
                for session in sessions:
                    group.create_task(run_episode(sample, session, group_id))

    try:
        async with asyncio.TaskGroup() as group:
            for sample in samples:
                group.create_task(run_group(sample))
    except BaseExceptionGroup as eg:
        raise _first_error(eg) from None  # callers get GatewayUnavailable etc., not a task-group wrapper
    finally:
        bar.close()
        if reward_pool is None:
            pool.close()
        await admin_http.aclose()
        await sdk_http.aclose()

    reward_stats = {k: v - getattr(stats_before, k) for k, v in pool.stats.as_dict().items()}
    summary = summarize(settings, tally, counters, reward_stats, time.monotonic() - started, prompts=len(samples))
    return summary


def _first_error(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def summarize(settings: RunnerSettings, tally: Tally, counters: Counters, reward_stats: dict[str, int],
              elapsed_s: float, *, prompts: int) -> dict[str, Any]:
    episodes = tally.episodes
    n = len(episodes)

    def mean(values: list[float]) -> float | None:
        return round(sum(values) / len(values), 4) if values else None

    return {
        "agent": settings.agent,
        "dataset": settings.dataset,
        "split": settings.split,
        "eval": settings.eval,
        "prompts": prompts,
        "sessions": prompts * settings.group_size,
        "episodes": n,
        "failed": tally.failed,
        "accuracy_turn1": mean([float(e.correct_first) for e in episodes]),
        "accuracy_final": mean([float(e.correct_final) for e in episodes]),
        "mean_reward": mean([e.reward for e in episodes]),
        "mean_turns": mean([float(len(e.turns)) for e in episodes]),
        "reward_timeouts": reward_stats["timeouts"],
        "reward_crashes": reward_stats["crashes"],
        "reward_errors": reward_stats["errors"],
        "reward_undecided": reward_stats["undecided"],
        **asdict(counters),
        "elapsed_s": round(elapsed_s, 1),
        "episodes_per_s": round(n / elapsed_s, 3) if elapsed_s > 0 else None,
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as aligned ``key: value`` lines, for the terminal."""
    width = max(len(k) for k in summary)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in summary.items())
