"""The agent runner: drive a dataset through the gateway with an example agent, and summarise.

For every prompt it creates ``group_size`` sessions sharing one group id (a GRPO group), runs the agent in
each (at most ``concurrency`` at a time), scores answers in a `RewardPool`, posts the rewards, finishes the
sessions, and returns a summary: accuracy of the first answer and of the last, mean reward, reward-pool
troubles and how often it had to back off.

    from agents.runner import RunnerSettings, run_agents
    summary = asyncio.run(run_agents(RunnerSettings(gateway="http://127.0.0.1:8000", admin_key="k",
                                                    dataset="synthetic:1", limit=8, group_size=4)))

Groups are reserved whole through `agentrl.client` (one admission decision per group). The gateway may be
briefly down (connection refused, 502/503/504) or refuse a group with 429 while the trainer is behind (the
staleness budget): both are retried with exponential backoff, honouring ``Retry-After``, for up to
``gateway_wait_s`` / ``admission_wait_s``; the progress bar shows the counts. When the gateway stays down,
`GatewayUnavailable` ends the run. An episode that fails (a model call
that fails for good, e.g. a 400, or an exception in the agent's own code) is counted as failed, its
session is abandoned (never trained on; its place in the staleness budget is freed), and the run goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any
import httpx2
from tqdm import tqdm

from agentrl.client import AsyncEpisode, AsyncGateway, AsyncGroup, GatewayError, GatewayUnavailable
from agentrl.episodes import run_groups

from agents.datasets import Sample, load_dataset
from agents.episode import Episode
from agents.math_agent import run_math_agent
from agents.rewards import RewardFn, RewardPool, math_reward
from agents.settings import AGENTS, DEFAULT_MAX_TURNS, RunnerSettings  # noqa: F401  (re-exported)
from agents.tool_agent import Tool, run_tool_agent

log = logging.getLogger(__name__)

@dataclass
class Counters:
    """How often the runner had to wait; the gateway's two come from `agentrl.client.Counters`."""

    backoffs_429: int = 0  # group reservations/rewards refused with 429 and retried after Retry-After
    gateway_retries: int = 0  # requests retried because the gateway was down or answered 502/503/504
    model_call_retries: int = 0  # model calls answered 429/5xx (the openai SDK retries those itself)

    def update(self, gateway: AsyncGateway) -> Counters:
        self.backoffs_429, self.gateway_retries = gateway.counters.backoffs_429, gateway.counters.gateway_retries
        return self


@dataclass(frozen=True)
class EpisodeRecord:
    """One ended session, handed to ``run_agents(on_episode=...)``; ``episode`` is None if it failed (the
    session was then abandoned)."""

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
    # one connection pool for every session's OpenAI client
    sdk_http = httpx2.AsyncClient(timeout=settings.request_timeout_s,
                                  limits=httpx2.Limits(max_connections=settings.concurrency + 4),
                                  event_hooks={"response": [count_model_retries]})
    gateway = AsyncGateway(settings.gateway, settings.admin_key, down_wait_s=settings.gateway_wait_s,
                           admission_wait_s=settings.admission_wait_s, sdk_http=sdk_http)
    bar = tqdm(total=len(samples) * settings.group_size, desc="eval" if settings.eval else settings.agent,
               unit="episode", disable=not settings.progress, dynamic_ncols=True)
    run_tag = uuid.uuid4().hex[:8]

    async def run_episode(sample: Sample, session: AsyncEpisode) -> None:
        client = session.async_openai(max_retries=5, timeout=settings.request_timeout_s)

        async def score(completion: str, reference: str) -> float:
            return await pool.score(reward_fn, completion, reference)

        async def post(response_id: str, reward: float) -> None:
            await session.reward(reward, response_id=response_id)

        episode: Episode | None = None
        try:
            common = dict(model=settings.model or session.model, max_turns=settings.max_turns,
                          temperature=settings.temperature, max_tokens=settings.max_tokens,
                          score=score, rewards=post)
            if settings.agent == "math":
                episode = await run_math_agent(client, sample, **common)
            else:
                episode = await run_tool_agent(client, sample, tools=tools, **common)
        except GatewayUnavailable:
            raise  # ends the run; abandoning would only wait for the same dead gateway
        except Exception as exc:  # noqa: BLE001 - the episode's own failure: counted, run goes on
            log.warning("episode of %s failed (session %s abandoned): %r", sample.id, session.session_id, exc)
        # as agentrl.client's `async with episode`: finished on success, abandoned on a failure (a
        # failed episode is never trained on, and its place in the budget is freed at once)
        try:
            await (session.finish() if episode is not None else session.abandon())
        except GatewayUnavailable:
            raise
        except GatewayError as exc:
            log.warning("could not %s session %s: %s", "finish" if episode else "abandon",
                        session.session_id, exc)
        if episode is None:
            tally.failed += 1
        else:
            tally.episodes.append(episode)
        if on_episode is not None:
            on_episode(EpisodeRecord(sample, session.session_id, session.group_id, episode))
        bar.update(1)
        bar.set_postfix(tally.postfix(counters.update(gateway)), refresh=False)

    @asynccontextmanager
    async def reserve(sample: Sample) -> AsyncIterator[AsyncGroup]:
        # reserved, not managed: run_episode ends each session itself (a group left by an error is not
        # abandoned here: with the gateway down that would only wait for it again)
        metadata = {"agent": settings.agent, "dataset": settings.dataset}
        yield await gateway.group(sample.id, settings.group_size, group_id=f"{sample.id}-{run_tag}",
                                  metadata=metadata, eval=settings.eval)

    try:  # callers get GatewayUnavailable etc., not a task-group wrapper
        await run_groups(samples, reserve, run_episode, concurrency=settings.concurrency,
                         group_size=settings.group_size)
    finally:
        bar.close()
        if reward_pool is None:
            pool.close()
        await gateway.aclose()
        await sdk_http.aclose()
    counters.update(gateway)

    reward_stats = {k: v - getattr(stats_before, k) for k, v in pool.stats.as_dict().items()}
    summary = summarize(settings, tally, counters, reward_stats, time.monotonic() - started, prompts=len(samples))
    return summary


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
