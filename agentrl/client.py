"""`agentrl.client`: what an agent needs to train through the gateway, in one object (sync and async).

A GRPO group is several episodes of one task. The gateway admits a whole group in one decision
(``POST /v1/groups``), so a staleness budget can never be used up by half-filled groups; each episode then
talks to the model through its own OpenAI-compatible base URL, which binds its turns to its session::

    from agentrl.client import AsyncGateway

    async with AsyncGateway("http://127.0.0.1:8000", key) as gateway:
        async with gateway.group("task-17", size=4) as group:        # one admission decision (429 waited out)
            async def one(episode):
                async with episode:                                    # finished on exit, abandoned on error
                    client = episode.async_openai()                    # an openai.AsyncOpenAI of this episode
                    r = await client.chat.completions.create(model=episode.model, messages=[...])
                    await episode.reward(score(r), response_id=r.id)   # or episode.reward(x): whole episode
            await asyncio.gather(*(one(e) for e in group))

`Gateway` is the same with plain methods (``with``, ``episode.openai()``: an ``openai.OpenAI``); its episodes
have no ``async_openai()`` (an ``AsyncOpenAI`` is closed by awaiting, which they cannot do): asyncio code
uses `AsyncGateway`. For other SDKs, an episode's ``base_url`` (``.../sessions/<id>/v1``) and ``api_key``
are all they need. Both clients run the same code for every operation; only the HTTP call differs.

Leaving a group's ``with`` block finishes every episode still open; an exception abandons the whole
group (its sessions are never trained on, and their places in the budget are freed). The same holds for
one episode's own ``with`` block. ``key`` is the gateway's admin key (or a key allowed to create groups).

Errors (``raise ... from`` the httpx error where one caused it)::

    GatewayError                 the gateway refused for good (4xx other than 429; 5xx other than 502-504)
     +-- SessionNotActive        409: the session is finished, abandoned or already trained on
     +-- GatewayUnavailable      down (connection refused, 502/503/504) or refusing with 429 for longer
                                 than ``down_wait_s`` / ``admission_wait_s``

Waiting: a 429 is retried after its ``Retry-After`` (seconds; exponential backoff when absent), for up to
``admission_wait_s``; a gateway that is down is retried with exponential backoff for up to ``down_wait_s``.
``Counters`` on the gateway object say how often each happened.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
import uuid
from collections.abc import Coroutine, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Generic, TypeVar
from urllib.parse import urljoin

import httpx

log = logging.getLogger(__name__)

__all__ = [
    "AsyncEpisode", "AsyncGateway", "AsyncGroup", "Counters", "Episode", "Gateway", "GatewayError",
    "GatewayUnavailable", "Group", "SessionNotActive",
]


class GatewayError(RuntimeError):
    """The gateway refused a request for good; ``status`` and ``code`` are its HTTP status and error code."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class SessionNotActive(GatewayError):
    """409: the session (or group) is finished, abandoned or already consumed by the trainer."""


class GatewayUnavailable(GatewayError):
    """The gateway stayed down, or kept refusing with 429, for longer than the client waits."""


@dataclass
class Counters:
    """How often the client had to wait (shared by every request of one gateway object)."""

    backoffs_429: int = 0  # requests refused with 429 and retried after Retry-After
    gateway_retries: int = 0  # requests retried because the gateway was down or answered 502/503/504


# ------------------------------------------------------------------------------------- retry policy

_DOWN_STATUSES = (502, 503, 504)


@dataclass
class _Attempts:
    """One request's retry state; `next_wait` decides between returning, waiting and raising."""

    what: str
    down_wait_s: float
    admission_wait_s: float
    counters: Counters
    started: float = field(default_factory=time.monotonic)
    attempt: int = 0
    slept: float = 0.0  # waits handed out so far (counted even if the caller's clock says less)

    def next_wait(self, response: httpx.Response | None, error: httpx.TransportError | None) -> float | None:
        """None: ``response`` is the answer. A float: wait that long and retry. Raises when giving up."""
        self.attempt += 1
        backoff = min(10.0, 0.25 * 2 ** min(self.attempt, 10)) * (0.75 + 0.5 * random.random())
        if error is not None:
            problem, limit = f"{type(error).__name__}: {error}", self.down_wait_s
            self.counters.gateway_retries += 1
        else:
            assert response is not None
            status = response.status_code
            if status < 400:
                return None
            message, code = _error_of(response)
            if status == 429:
                problem, limit = f"429 {message}", self.admission_wait_s
                self.counters.backoffs_429 += 1
                backoff = _retry_after(response, backoff)
            elif status in _DOWN_STATUSES:
                problem, limit = f"{status} {message}", self.down_wait_s
                self.counters.gateway_retries += 1
            else:
                kind = SessionNotActive if status == 409 else GatewayError
                raise kind(f"{self.what} -> {status}: {message}", status=status, code=code)
        waited = max(time.monotonic() - self.started, self.slept)
        if waited + backoff > limit:
            raise GatewayUnavailable(f"{self.what}: still failing after {waited:.0f}s ({self.attempt} attempts): "
                                     f"{problem}", status=None if response is None else response.status_code,
                                     code=None if response is None else _error_of(response)[1]) from error
        log.info("%s: %s; retrying in %.1fs", self.what, problem, backoff)
        self.slept += backoff
        return float(backoff)


def _error_of(response: httpx.Response) -> tuple[str, str | None]:
    """(message, code) of an OpenAI-shaped error body, or the start of whatever the body is."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:300], None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        code = error.get("code")
        return str(error.get("message")), None if code is None else str(code)
    return str(body)[:300], None


def _retry_after(response: httpx.Response, fallback: float) -> float:
    """``Retry-After`` in seconds (the gateway sends a number); ``fallback`` when absent or not a number."""
    try:
        value = float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return fallback
    return value if math.isfinite(value) and value >= 0 else fallback


# ------------------------------------------------------------------------------------- shared pieces


@dataclass(frozen=True)
class _Session:
    session_id: str
    api_key: str
    base_url: str


def _group_body(task_id: str | None, size: int, group_id: str | None, metadata: dict[str, Any] | None,
                eval: bool) -> dict[str, Any]:
    if size < 1:
        raise ValueError(f"a group needs at least one episode, got size={size}")
    meta = dict(metadata or {})
    if eval:
        meta["eval"] = True  # recorded, never trained on, outside the staleness budget
    body: dict[str, Any] = {"size": size, "group_id": group_id or f"{task_id or 'group'}-{uuid.uuid4().hex[:10]}",
                            "metadata": meta}
    if task_id is not None:
        body["task_id"] = task_id
    return body


def _sessions_of(gateway_url: str, body: Any) -> list[_Session]:
    # base_url may be absolute or relative to the gateway
    return [_Session(str(s["session_id"]), str(s["api_key"]), urljoin(gateway_url + "/", str(s["base_url"])))
            for s in body["sessions"]]


def _reward_body(value: float, session_id: str, response_id: str | None) -> dict[str, Any]:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"a reward must be a finite number, got {value}")
    return {"response_id": response_id, "reward": value} if response_id else {"session_id": session_id, "reward": value}


def _check_url(url: str) -> str:
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"the gateway URL must be http(s)://HOST:PORT, got {url!r}")
    if url.endswith("/v1"):
        raise ValueError(f"give the gateway's root URL, without /v1: {url[:-3]}")
    return url


# ------------------------------------------------------------------ one code path for sync and async
#
# Every operation (the served model, reserving a group, a reward, finishing, abandoning) is written once,
# as a generator of steps: it yields what it needs done, a `_Send` of one HTTP request, a `_Sleep` before
# a retry or a `_Close` of an SDK client, and is sent the result (or has the error thrown into it). The retry
# policy is such a generator too (`_request_steps`). `Gateway` performs the steps with blocking calls,
# `AsyncGateway` with awaited ones; only `__init__` and `_perform` differ between the two, so the two
# clients cannot drift apart.

T = TypeVar("T")
Steps = Generator[Any, Any, T]


@dataclass(frozen=True)
class _Send:
    """One HTTP request to the gateway, as it is (no retry)."""

    method: str
    url: str
    json: Any
    headers: dict[str, str]
    params: dict[str, Any] | None


@dataclass(frozen=True)
class _Sleep:
    seconds: float


@dataclass(frozen=True)
class _Close:
    client: Any  # an SDK client made for an episode without a shared connection pool


class _Run:
    """One operation's steps as a driver advances them; the whole driver is::

        run = _Run(steps)
        while run.next():
            with run.capture():
                run.sent = perform(run.step)     # or: await perform(run.step)
        return run.result
    """

    def __init__(self, steps: Steps[Any]) -> None:
        self.steps = steps
        self.step: Any = None
        self.sent: Any = None
        self.error: Exception | None = None
        self.result: Any = None

    def next(self) -> bool:
        """Hand the last step's result (or error) to the steps; False once they returned ``result``."""
        try:
            self.step = self.steps.throw(self.error) if self.error is not None else self.steps.send(self.sent)
        except StopIteration as stop:
            self.result = stop.value
            return False
        self.sent, self.error = None, None
        return True

    @contextmanager
    def capture(self) -> Iterator[None]:
        """An exception of the step is thrown into the steps at their ``yield``: they decide what it means."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - handed on, not swallowed
            self.error = exc


class _GatewayBase:
    """What `Gateway` and `AsyncGateway` share: every operation's steps. Each adds ``_perform`` (a step done
    blocking or awaited), the driver ``_run`` over it, and the public methods, plain or ``async``."""

    def __init__(self, url: str, key: str, *, down_wait_s: float, admission_wait_s: float, sdk_http: Any) -> None:
        self.url = _check_url(url)
        self.headers = {"Authorization": f"Bearer {key}"}
        self.down_wait_s = down_wait_s
        self.admission_wait_s = admission_wait_s
        self.counters = Counters()
        self._sdk_http = sdk_http  # an httpx2 client shared by the episodes' OpenAI SDK clients
        self._model: str | None = None

    def _request_steps(self, method: str, path: str, *, json: Any = None, key: str | None = None,
                       params: dict[str, Any] | None = None) -> Steps[httpx.Response]:
        """One call with the retry policy of the module docstring; returns the 2xx response."""
        attempts = _Attempts(f"{method} {self.url}{path}", self.down_wait_s, self.admission_wait_s, self.counters)
        headers = {"Authorization": f"Bearer {key}"} if key else self.headers
        while True:
            try:
                response = yield _Send(method, self.url + path, json, headers, params)
            except httpx.TransportError as exc:
                wait = attempts.next_wait(None, exc)
            else:
                wait = attempts.next_wait(response, None)
                if wait is None:
                    return response
            assert wait is not None
            yield _Sleep(wait)

    def _model_steps(self) -> Steps[str]:
        if self._model is None:
            data = (yield from self._request_steps("GET", "/v1/models")).json().get("data") or []
            if not data:
                raise GatewayError("GET /v1/models lists no model")
            self._model = str(data[0]["id"])
        return self._model

    def _group_steps(self, body: dict[str, Any], task_id: str | None) -> Steps[Any]:
        model = yield from self._model_steps()
        created = (yield from self._request_steps("POST", "/v1/groups", json=body)).json()
        group_id = str(created["group_id"])
        episodes = [self._episode(self, s, group_id=group_id, task_id=task_id, model=model)
                    for s in _sessions_of(self.url, created)]
        return self._group(self, group_id, task_id, episodes)

    def _reward_steps(self, response_id: str, value: float) -> Steps[None]:
        yield from self._request_steps("POST", "/reward", json=_reward_body(value, "", response_id))

    def _group_status_steps(self, group_id: str) -> Steps[dict[str, Any]]:
        return dict((yield from self._request_steps("GET", f"/v1/groups/{group_id}")).json())

    _episode: type[_EpisodeBase]
    _group: type[_GroupBase[Any]]


class _EpisodeBase:
    """What sync and async episodes share: identity, state, and the steps of reward, finish and abandon."""

    def __init__(self, gateway: Any, session: _Session, *, group_id: str, task_id: str | None, model: str) -> None:
        self.gateway = gateway
        self.session_id = session.session_id
        self.api_key = session.api_key
        self.base_url = session.base_url  # OpenAI-compatible: .../sessions/<id>/v1, for any SDK
        self.group_id = group_id
        self.task_id = task_id
        self.model = model  # the served model's name (first of GET /v1/models)
        self.status = "active"  # -> finished | abandoned (as far as this client knows)
        self.eval = False  # set by runners: an evaluation episode (recorded, never trained on)
        self.temperature = 1.0  # set by runners: the sampling temperature asked for (0 when evaluating)
        self.rewards: list[tuple[str | None, float]] = []  # (response_id or None for the episode, reward)
        self._owned: list[Any] = []  # SDK clients made here without a shared connection pool

    @property
    def active(self) -> bool:
        return self.status == "active"

    def _sdk(self, cls: Any, shared_http: Any, kwargs: dict[str, Any]) -> Any:
        if shared_http is not None:
            kwargs.setdefault("http_client", shared_http)
        client = cls(base_url=self.base_url, api_key=self.api_key, **kwargs)
        if "http_client" not in kwargs:
            self._owned.append(client)
        return client

    def openai(self, **kwargs: Any) -> Any:
        """An ``openai.OpenAI`` bound to this episode (extra keyword arguments go to its constructor)."""
        import openai

        return self._sdk(openai.OpenAI, self._openai_http(), kwargs)

    def _openai_http(self) -> Any:
        """The shared connection pool for ``openai()``'s clients: the gateway's ``sdk_http`` where it is a sync one."""
        return None

    def child(self, parent_response_id: str, *, link: str = "spawn", thread: str | None = None) -> SubAgent:
        """A sub-agent of this episode, started by the turn ``parent_response_id`` (or, with
        ``link="compaction"``, the window that continues from a summary that turn wrote). Its SDK clients talk
        to this episode's session with the gateway's episode headers (``X-AgentRL-Parent-Response``,
        ``X-AgentRL-Link``, ``X-AgentRL-Thread``: docs/coding-agents.md), so its turns are recorded as a
        thread of this episode, ``spawned_by`` (or ``compacted_from``) that turn, under its reward."""
        if not isinstance(parent_response_id, str) or not parent_response_id:
            raise ValueError("child() needs the response id of the turn that started the sub-agent")
        if link not in CHILD_LINKS:
            raise ValueError(f"link {link!r}: use one of {', '.join(CHILD_LINKS)}")
        headers = {"X-AgentRL-Parent-Response": parent_response_id, "X-AgentRL-Link": link}
        if thread is not None:
            headers["X-AgentRL-Thread"] = thread
        return SubAgent(self, headers)

    def _reward_steps(self, value: float, response_id: str | None) -> Steps[None]:
        yield from self.gateway._request_steps("POST", "/reward", json=_reward_body(value, self.session_id, response_id),
                                               key=self.api_key)
        self.rewards.append((response_id, float(value)))

    def _end_steps(self, action: str) -> Steps[None]:
        """``finish`` or ``abandon`` this episode (idempotent), then close the SDK clients made for it."""
        if self.active:
            yield from self.gateway._request_steps("POST", f"/v1/sessions/{self.session_id}/{action}")
            self.status = "finished" if action == "finish" else "abandoned"
        yield from self._close_owned_steps()

    def _close_owned_steps(self) -> Steps[None]:
        owned, self._owned = self._owned, []
        for client in owned:
            yield _Close(client)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.session_id} group={self.group_id} task={self.task_id} {self.status}>"


CHILD_LINKS = ("spawn", "compaction")  # the gateway's X-AgentRL-Link kinds (gateway/episodes/signals.py)


class SubAgent:
    """SDK clients for a sub-agent (or compacted window) of an episode: ``episode.child(response_id)``."""

    def __init__(self, episode: _EpisodeBase, headers: dict[str, str]) -> None:
        self.episode = episode
        self.headers = headers  # sent with every request of its clients

    def _with_headers(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {**kwargs, "default_headers": {**self.headers, **(kwargs.get("default_headers") or {})}}

    def openai(self, **kwargs: Any) -> Any:
        """An ``openai.OpenAI`` bound to the episode, its requests linked as this sub-agent's thread."""
        return self.episode.openai(**self._with_headers(kwargs))

    def async_openai(self, **kwargs: Any) -> Any:
        """An ``openai.AsyncOpenAI`` bound to the episode (async gateways only, as ``episode.async_openai``)."""
        return self.episode.async_openai(**self._with_headers(kwargs))  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"<SubAgent of {self.episode.session_id} {self.headers}>"


E = TypeVar("E", bound=_EpisodeBase)


class _GroupBase(Generic[E]):
    def __init__(self, gateway: Any, group_id: str, task_id: str | None, episodes: list[E]) -> None:
        self.gateway = gateway
        self.group_id = group_id
        self.task_id = task_id
        self.episodes = episodes

    @property
    def size(self) -> int:
        return len(self.episodes)

    def __iter__(self) -> Iterator[E]:
        return iter(self.episodes)

    def __len__(self) -> int:
        return len(self.episodes)

    def __getitem__(self, i: int) -> E:
        return self.episodes[i]

    def _finish_steps(self) -> Steps[None]:
        for episode in self.episodes:
            yield from episode._end_steps("finish")

    def _abandon_steps(self) -> Steps[None]:
        yield from self.gateway._request_steps("POST", f"/v1/groups/{self.group_id}/abandon")
        for episode in self.episodes:
            if episode.active:
                episode.status = "abandoned"
            yield from episode._close_owned_steps()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.group_id} task={self.task_id} size={self.size}>"


def _end_steps(thing: _EpisodeBase | _GroupBase[Any], exc: BaseException | None) -> Steps[None]:
    """Leaving a ``with`` block: finish on success, abandon on an exception (whose report wins)."""
    if isinstance(exc, GatewayUnavailable):  # abandoning would wait for the same dead gateway; its timeout cleans up
        return
    try:
        if isinstance(thing, _GroupBase):
            yield from (thing._finish_steps() if exc is None else thing._abandon_steps())
        else:
            yield from thing._end_steps("finish" if exc is None else "abandon")
    except GatewayError:
        if exc is None:
            raise
        log.warning("could not abandon %r after %r", thing, exc)  # the original error matters more


# ------------------------------------------------------------------------------------------- sync


class Gateway(_GatewayBase):
    """The gateway's session API, synchronous. ``key``: the admin key (or one allowed to create groups).

    Its episodes hand out ``openai.OpenAI`` clients (``episode.openai()``); for ``openai.AsyncOpenAI``
    use `AsyncGateway`, whose episodes are awaited.
    """

    def __init__(self, url: str, key: str, *, timeout_s: float = 60.0, down_wait_s: float = 120.0,
                 admission_wait_s: float = 3600.0, http: httpx.Client | None = None,
                 sdk_http: Any = None) -> None:
        super().__init__(url, key, down_wait_s=down_wait_s, admission_wait_s=admission_wait_s, sdk_http=sdk_http)
        self._http = http or httpx.Client(timeout=timeout_s)
        self._owns_http = http is None

    def request(self, method: str, path: str, *, json: Any = None, key: str | None = None,
                params: dict[str, Any] | None = None) -> httpx.Response:
        """One call with the retry policy of the module docstring; returns the 2xx response."""
        return self._run(self._request_steps(method, path, json=json, key=key, params=params))

    def _run(self, steps: Steps[T]) -> T:
        run = _Run(steps)
        while run.next():
            with run.capture():
                run.sent = self._perform(run.step)
        return run.result  # type: ignore[no-any-return]

    def _perform(self, step: _Send | _Sleep | _Close) -> Any:
        if isinstance(step, _Send):
            return self._http.request(step.method, step.url, json=step.json, headers=step.headers, params=step.params)
        if isinstance(step, _Sleep):
            return time.sleep(step.seconds)
        return step.client.close()

    def model(self) -> str:
        """The served model's name (first of ``GET /v1/models``), asked once."""
        return self._run(self._model_steps())

    def group(self, task_id: str | None = None, size: int = 4, *, group_id: str | None = None,
              metadata: dict[str, Any] | None = None, eval: bool = False) -> Group:
        """Reserve ``size`` episodes of ``task_id`` in one admission decision (waits out 429s)."""
        return self._run(self._group_steps(_group_body(task_id, size, group_id, metadata, eval), task_id))

    def reward(self, response_id: str, value: float) -> None:
        """Reward one turn by its response id (``response.id``)."""
        self._run(self._reward_steps(response_id, value))

    def group_status(self, group_id: str) -> dict[str, Any]:
        """``GET /v1/groups/{id}``: the group's status and each session's status and reward."""
        return self._run(self._group_status_steps(group_id))

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> Gateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Episode(_EpisodeBase):
    """One session of a group (sync). ``with episode:`` finishes it on exit and abandons it on an error."""

    gateway: Gateway

    def _openai_http(self) -> Any:
        return self.gateway._sdk_http

    def async_openai(self, **kwargs: Any) -> Any:
        """Not here: an ``openai.AsyncOpenAI`` must be closed by awaiting, which a synchronous episode cannot
        do. Use `AsyncGateway` (``async with AsyncGateway(url, key) as gateway``), whose episodes have it."""
        raise TypeError("Episode.async_openai(): this episode belongs to the synchronous Gateway, which hands out "
                        "openai.OpenAI clients (episode.openai()); for openai.AsyncOpenAI use AsyncGateway "
                        "(async with AsyncGateway(url, key) as gateway: ... episode.async_openai())")

    def reward(self, value: float, *, response_id: str | None = None) -> None:
        """Reward one turn (``response_id``) or, without it, the whole episode."""
        self.gateway._run(self._reward_steps(value, response_id))

    def finish(self) -> None:
        """Done: the session waits for the rest of its group, then goes to the trainer. Idempotent."""
        self.gateway._run(self._end_steps("finish"))

    def abandon(self) -> None:
        """Give up: never trained on; its place in the budget is freed."""
        self.gateway._run(self._end_steps("abandon"))

    def __enter__(self) -> Episode:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.gateway._run(_end_steps(self, exc))


class Group(_GroupBase[Episode]):
    """A reserved group (sync). ``with group:`` finishes open episodes on exit, abandons all on an error."""

    gateway: Gateway

    def finish(self) -> None:
        self.gateway._run(self._finish_steps())

    def abandon(self) -> None:
        self.gateway._run(self._abandon_steps())

    def __enter__(self) -> Group:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.gateway._run(_end_steps(self, exc))


Gateway._episode, Gateway._group = Episode, Group  # what _group_steps builds for this client


# ------------------------------------------------------------------------------------------ async


class AsyncGateway(_GatewayBase):
    """The gateway's session API for asyncio; the same methods as `Gateway`, awaited."""

    def __init__(self, url: str, key: str, *, timeout_s: float = 60.0, down_wait_s: float = 120.0,
                 admission_wait_s: float = 3600.0, http: httpx.AsyncClient | None = None,
                 sdk_http: Any = None) -> None:
        super().__init__(url, key, down_wait_s=down_wait_s, admission_wait_s=admission_wait_s, sdk_http=sdk_http)
        self._http = http or httpx.AsyncClient(timeout=timeout_s)
        self._owns_http = http is None

    async def request(self, method: str, path: str, *, json: Any = None, key: str | None = None,
                      params: dict[str, Any] | None = None) -> httpx.Response:
        """One call with the retry policy of the module docstring; returns the 2xx response."""
        return await self._run(self._request_steps(method, path, json=json, key=key, params=params))

    async def _run(self, steps: Steps[T]) -> T:
        run = _Run(steps)
        while run.next():
            with run.capture():
                run.sent = await self._perform(run.step)
        return run.result  # type: ignore[no-any-return]

    async def _perform(self, step: _Send | _Sleep | _Close) -> Any:
        if isinstance(step, _Send):
            return await self._http.request(step.method, step.url, json=step.json, headers=step.headers,
                                            params=step.params)
        if isinstance(step, _Sleep):
            return await asyncio.sleep(step.seconds)
        closed = step.client.close()  # openai.OpenAI's is plain, AsyncOpenAI's a coroutine
        return await closed if asyncio.iscoroutine(closed) else closed

    async def model(self) -> str:
        """The served model's name (first of ``GET /v1/models``), asked once."""
        return await self._run(self._model_steps())

    def group(self, task_id: str | None = None, size: int = 4, *, group_id: str | None = None,
              metadata: dict[str, Any] | None = None, eval: bool = False) -> _Reservation:
        """Reserve ``size`` episodes of ``task_id`` in one admission decision (waits out 429s).

        ``async with gateway.group(...) as group:`` (finished / abandoned at the end of the block), or
        ``group = await gateway.group(...)`` to manage it yourself.
        """
        body = _group_body(task_id, size, group_id, metadata, eval)
        return _Reservation(self._run(self._group_steps(body, task_id)))

    async def reward(self, response_id: str, value: float) -> None:
        """Reward one turn by its response id (``response.id``)."""
        await self._run(self._reward_steps(response_id, value))

    async def group_status(self, group_id: str) -> dict[str, Any]:
        """``GET /v1/groups/{id}``: the group's status and each session's status and reward."""
        return await self._run(self._group_status_steps(group_id))

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncGateway:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _Reservation:
    """What `AsyncGateway.group` returns: awaitable (the group) and an async context manager over it."""

    def __init__(self, reserve: Coroutine[Any, Any, AsyncGroup]) -> None:
        self._reserve = reserve
        self._group: AsyncGroup | None = None

    def __await__(self) -> Generator[Any, None, AsyncGroup]:
        return self._reserve.__await__()

    async def __aenter__(self) -> AsyncGroup:
        self._group = await self._reserve
        return self._group

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        assert self._group is not None
        await self._group.gateway._run(_end_steps(self._group, exc))


class AsyncEpisode(_EpisodeBase):
    """One session of a group (async). ``async with episode:`` finishes it on exit, abandons it on an error."""

    gateway: AsyncGateway

    def async_openai(self, **kwargs: Any) -> Any:
        """An ``openai.AsyncOpenAI`` bound to this episode (extra keyword arguments go to its constructor)."""
        import openai

        return self._sdk(openai.AsyncOpenAI, self.gateway._sdk_http, kwargs)

    async def reward(self, value: float, *, response_id: str | None = None) -> None:
        """Reward one turn (``response_id``) or, without it, the whole episode."""
        await self.gateway._run(self._reward_steps(value, response_id))

    async def finish(self) -> None:
        """Done: the session waits for the rest of its group, then goes to the trainer. Idempotent."""
        await self.gateway._run(self._end_steps("finish"))

    async def abandon(self) -> None:
        """Give up: never trained on; its place in the budget is freed."""
        await self.gateway._run(self._end_steps("abandon"))

    async def __aenter__(self) -> AsyncEpisode:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.gateway._run(_end_steps(self, exc))


class AsyncGroup(_GroupBase[AsyncEpisode]):
    """A reserved group (async). ``async with group:`` finishes open episodes on exit, abandons all on error."""

    gateway: AsyncGateway

    async def finish(self) -> None:
        await self.gateway._run(self._finish_steps())

    async def abandon(self) -> None:
        await self.gateway._run(self._abandon_steps())

    async def __aenter__(self) -> AsyncGroup:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.gateway._run(_end_steps(self, exc))


AsyncGateway._episode, AsyncGateway._group = AsyncEpisode, AsyncGroup
