"""Run your own agent: an async *episode function* over a JSONL file of tasks, through the gateway.

An episode function is what ``agentrl up --agent module:function`` and ``agentrl eval`` call, once per
episode (``group_size`` times per task)::

    async def episode(client: agentrl.client.AsyncEpisode, task: dict) -> float | None:
        openai = client.async_openai()
        reply = await openai.chat.completions.create(model=client.model, messages=[...],
                                                     temperature=client.temperature)
        return 1.0 if task["answer"] in reply.choices[0].message.content else 0.0

It returns the episode's reward (posted for it), or None when it posted its own rewards
(``await client.reward(x, response_id=reply.id)``). ``client.temperature`` is the sampling temperature
asked for (0 during evaluation); ``client.eval`` says whether this is an evaluation episode. An exception
in the function abandons that episode (it is never trained on) and is counted as ``failed``.

Tasks are JSON objects, one per line; ``id`` (or ``task_id``) names a task, otherwise its line number does.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import logging
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from agentrl.client import AsyncEpisode, AsyncGateway, GatewayUnavailable

log = logging.getLogger(__name__)

EpisodeFn = Callable[[AsyncEpisode, dict[str, Any]], Awaitable[float | None]]
T = TypeVar("T")


class EpisodeFnError(ValueError):
    """``--agent module:function`` does not name an async function; the message says how to fix it."""


def load_episode_fn(spec: str) -> EpisodeFn:
    """Import ``module:function`` (the working directory is importable, as for ``python -m``)."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise EpisodeFnError(f"--agent {spec!r}: use module:function, e.g. my_agent:episode")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EpisodeFnError(f"--agent {spec!r}: cannot import {module_name!r} ({exc}); run from the directory "
                             "that holds it or put it on PYTHONPATH") from exc
    fn = getattr(module, name, None)
    if fn is None:
        raise EpisodeFnError(f"--agent {spec!r}: module {module_name!r} has no {name!r}")
    if not inspect.iscoroutinefunction(fn):
        raise EpisodeFnError(f"--agent {spec!r}: {name} must be an async function (async def {name}(client, task))")
    return fn  # type: ignore[no-any-return]


def load_tasks(path: str | Path, *, limit: int = 0) -> list[dict[str, Any]]:
    """Tasks from a JSONL file in file order (one object per line; blank lines skipped), each with an ``id``;
    the first ``limit`` (0: all)."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise EpisodeFnError(f"cannot read tasks from {path}: {exc}") from exc
    tasks = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            task = json.loads(line)
        except ValueError as exc:
            raise EpisodeFnError(f"{path}:{n}: not JSON ({exc})") from exc
        if not isinstance(task, dict):
            raise EpisodeFnError(f"{path}:{n}: a task must be a JSON object, got {type(task).__name__}")
        task.setdefault("id", str(task.get("task_id", f"{path.stem}-{n}")))
        task["id"] = str(task["id"])
        tasks.append(task)
    if not tasks:
        raise EpisodeFnError(f"{path} holds no tasks")
    return tasks[:limit] if limit else tasks


@dataclass
class EpisodeResults:
    """Rewards per task (a task's episodes, in order), failures, and the client's waiting counters."""

    rewards: dict[str, list[float]] = field(default_factory=dict)
    failed: int = 0
    unrewarded: int = 0  # returned None and posted nothing: the gateway has no reward for them

    def add(self, task_id: str, reward: float) -> None:
        self.rewards.setdefault(task_id, []).append(reward)

    def mean(self) -> float | None:
        values = [r for rs in self.rewards.values() for r in rs]
        return sum(values) / len(values) if values else None

    def postfix(self) -> dict[str, Any]:
        mean = self.mean()
        return {"reward": "-" if mean is None else f"{mean:.3f}", "failed": self.failed}

    def summary(self, *, elapsed_s: float, backoffs_429: int, gateway_retries: int) -> dict[str, Any]:
        """Rewards only: accuracy is the example agents' notion (agents.runner); an episode function has none."""
        mean = self.mean()
        return {
            "episodes": sum(len(rs) for rs in self.rewards.values()), "failed": self.failed,
            "unrewarded": self.unrewarded, "mean_reward": None if mean is None else round(mean, 4),
            "task_rewards": self.rewards, "backoffs_429": backoffs_429,
            "gateway_retries": gateway_retries, "elapsed_s": round(elapsed_s, 1),
        }


async def run_groups(items: Iterable[T], reserve: Callable[[T], AbstractAsyncContextManager[Iterable[AsyncEpisode]]],
                     run: Callable[[T, AsyncEpisode], Awaitable[None]], *, concurrency: int, group_size: int) -> None:
    """Run a group of episodes per item: ``reserve(item)`` opens the item's group (reserved whole, one
    admission decision), ``run(item, episode)`` runs each of its episodes. At most ``concurrency``
    episodes run at once, and only as many groups are open as those slots can run, so the sessions the
    gateway has admitted track the agents running. The first error ends the run and is raised as itself
    (``GatewayUnavailable``...), not wrapped in a task group's exception group.

    Serves both runners: :func:`run_episodes` (episode functions) and ``agents.runner.run_agents`` (the
    example agents)."""
    slots = asyncio.Semaphore(concurrency)
    group_slots = asyncio.Semaphore(max(1, math.ceil(concurrency / group_size)))

    async def one(item: T, episode: AsyncEpisode) -> None:
        async with slots:
            await run(item, episode)

    async def group(item: T) -> None:
        async with group_slots:
            async with reserve(item) as episodes:
                async with asyncio.TaskGroup() as each:
                    for episode in episodes:
                        each.create_task(one(item, episode))

    try:
        async with asyncio.TaskGroup() as all_groups:
            for item in items:
                all_groups.create_task(group(item))
    except BaseExceptionGroup as eg:
        raise first_error(eg) from None


def first_error(error: BaseException) -> BaseException:
    """The first exception inside (nested) exception groups."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


async def run_episodes(fn: EpisodeFn, tasks: Sequence[dict[str, Any]], *, gateway: str, key: str,
                       group_size: int, eval: bool = False, temperature: float = 1.0, concurrency: int = 8,
                       metadata: dict[str, Any] | None = None, progress: bool = False) -> dict[str, Any]:
    """Run ``fn`` ``group_size`` times on every task (one reserved group per task); return the summary.
    ``progress``: a bar of episodes done, with the mean reward so far and the failures."""
    from tqdm import tqdm

    results = EpisodeResults()
    bar = tqdm(total=len(tasks) * group_size, desc="eval" if eval else "train", unit="episode",
               disable=not progress, dynamic_ncols=True)
    started = time.monotonic()

    async with AsyncGateway(gateway, key) as gw:
        async def one(task: dict[str, Any], episode: AsyncEpisode) -> None:
            episode.eval, episode.temperature = eval, temperature
            try:
                async with episode:  # finished on return, abandoned on an exception
                    reward = await fn(episode, task)
                    if reward is not None:
                        await episode.reward(float(reward))
            except GatewayUnavailable:
                raise
            except Exception as exc:  # noqa: BLE001 - the agent's own failure: counted, run goes on
                log.warning("episode of task %s failed (session %s abandoned): %r", task["id"],
                            episode.session_id, exc)
                results.failed += 1
                bar.update(1)
                return
            if not episode.rewards:
                results.unrewarded += 1
                log.warning("episode of task %s returned no reward and posted none", task["id"])
            results.add(task["id"], episode.rewards[-1][1] if episode.rewards else 0.0)
            bar.update(1)
            bar.set_postfix(results.postfix(), refresh=False)

        def reserve(task: dict[str, Any]) -> AbstractAsyncContextManager[Iterable[AsyncEpisode]]:
            # finished (or, on an error, abandoned) at the end of the group's block
            return gw.group(task["id"], size=group_size, eval=eval, metadata={**(metadata or {}), "eval": eval})

        try:
            await run_groups(tasks, reserve, one, concurrency=concurrency, group_size=group_size)
        finally:
            bar.close()
        return results.summary(elapsed_s=time.monotonic() - started, backoffs_429=gw.counters.backoffs_429,
                               gateway_retries=gw.counters.gateway_retries)
