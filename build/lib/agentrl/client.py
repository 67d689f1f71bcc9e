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

`Gateway` is the same with plain methods (``with``, ``episode.openai()``). For other SDKs, an episode's
``base_url`` (``.../sessions/<id>/v1``) and ``api_key`` are all they need.

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


class _EpisodeBase:
    """What sync and async episodes share: identity, state and the per-episode OpenAI clients."""

    def __init__(self, session: _Session, *, group_id: str, task_id: str | None, model: str,
                 sdk_http: Any = None, async_sdk_http: Any = None) -> None:
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
        self._sdk_http = sdk_http
        self._async_sdk_http = async_sdk_http
        self._owned: list[Any] = []  # SDK clients made here without a shared connection pool

    @property
    def active(self) -> bool:
        return self.status == "active"

    def openai(self, **kwargs: Any) -> Any:
        """An ``openai.OpenAI`` bound to this episode (extra keyword arguments go to its constructor)."""
        import openai

        if self._sdk_http is not None:
            kwargs.setdefault("http_client", self._sdk_http)
        client = openai.OpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)
        if "http_client" not in kwargs:
            self._owned.append(client)
        return client

    def async_openai(self, **kwargs: Any) -> Any:
        """An ``openai.AsyncOpenAI`` bound to this episode (extra keyword arguments go to its constructor)."""
        import openai

        if self._async_sdk_http is not None:
            kwargs.setdefault("http_client", self._async_sdk_http)
        client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)
        if "http_client" not in kwargs:
            self._owned.append(client)
        return client

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.session_id} group={self.group_id} task={self.task_id} {self.status}>"


E = TypeVar("E", bound=_EpisodeBase)


class _GroupBase(Generic[E]):
    def __init__(self, group_id: str, task_id: str | None, episodes: list[E]) -> None:
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

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.group_id} task={self.task_id} size={self.size}>"


# ------------------------------------------------------------------------------------------- sync


class Gateway:
    """The gateway's session API, synchronous. ``key``: the admin key (or one allowed to create groups)."""

    def __init__(self, url: str, key: str, *, timeout_s: float = 60.0, down_wait_s: float = 120.0,
                 admission_wait_s: float = 3600.0, http: httpx.Client | None = None,
                 sdk_http: Any = None) -> None:
        self.url = _check_url(url)
        self.headers = {"Authorization": f"Bearer {key}"}
        self.down_wait_s = down_wait_s
        self.admission_wait_s = admission_wait_s
        self.counters = Counters()
        self._http = http or httpx.Client(timeout=timeout_s)
        self._owns_http = http is None
        self._sdk_http = sdk_http  # an httpx2.Client shared by the episodes' openai.OpenAI clients
        self._model: str | None = None

    def request(self, method: str, path: str, *, json: Any = None, key: str | None = None,
                params: dict[str, Any] | None = None) -> httpx.Response:
        """One call with the retry policy of the module docstring; returns the 2xx response."""
        headers = {"Authorization": f"Bearer {key}"} if key else self.headers
        attempts = _Attempts(f"{method} {self.url}{path}", self.down_wait_s, self.admission_wait_s, self.counters)
        while True:
            try:
                response = self._http.request(method, self.url + path, json=json, headers=headers, params=params)
            except httpx.TransportError as exc:
                wait = attempts.next_wait(None, exc)
            else:
                wait = attempts.next_wait(response, None)
                if wait is None:
                    return response
            assert wait is not None
            time.sleep(wait)

    def model(self) -> str:
        """The served model's name (first of ``GET /v1/models``), asked once."""
        if self._model is None:
            data = self.request("GET", "/v1/models").json().get("data") or []
            if not data:
                raise GatewayError("GET /v1/models lists no model")
            self._model = str(data[0]["id"])
        return self._model

    def group(self, task_id: str | None = None, size: int = 4, *, group_id: str | None = None,
              metadata: dict[str, Any] | None = None, eval: bool = False) -> Group:
        """Reserve ``size`` episodes of ``task_id`` in one admission decision (waits out 429s)."""
        body = _group_body(task_id, size, group_id, metadata, eval)
        model = self.model()
        created = self.request("POST", "/v1/groups", json=body).json()
        episodes = [Episode(self, s, group_id=str(created["group_id"]), task_id=task_id, model=model,
                            sdk_http=self._sdk_http) for s in _sessions_of(self.url, created)]
        return Group(self, str(created["group_id"]), task_id, episodes)

    def reward(self, response_id: str, value: float) -> None:
        """Reward one turn by its response id (``response.id``)."""
        self.request("POST", "/reward", json=_reward_body(value, "", response_id))

    def group_status(self, group_id: str) -> dict[str, Any]:
        """``GET /v1/groups/{id}``: the group's status and each session's status and reward."""
        return dict(self.request("GET", f"/v1/groups/{group_id}").json())

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> Gateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Episode(_EpisodeBase):
    """One session of a group (sync). ``with episode:`` finishes it on exit and abandons it on an error."""

    def __init__(self, gateway: Gateway, session: _Session, **kw: Any) -> None:
        super().__init__(session, **kw)
        self.gateway = gateway

    def reward(self, value: float, *, response_id: str | None = None) -> None:
        """Reward one turn (``response_id``) or, without it, the whole episode."""
        self.gateway.request("POST", "/reward", json=_reward_body(value, self.session_id, response_id),
                             key=self.api_key)
        self.rewards.append((response_id, float(value)))

    def finish(self) -> None:
        """Done: the session waits for the rest of its group, then goes to the trainer. Idempotent."""
        if self.active:
            self.gateway.request("POST", f"/v1/sessions/{self.session_id}/finish")
            self.status = "finished"
        self._close_owned()

    def abandon(self) -> None:
        """Give up: never trained on; its place in the budget is freed."""
        if self.active:
            self.gateway.request("POST", f"/v1/sessions/{self.session_id}/abandon")
            self.status = "abandoned"
        self._close_owned()

    def _close_owned(self) -> None:
        for client in self._owned:
            client.close()
        self._owned.clear()

    def __enter__(self) -> Episode:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        _end_sync(self, exc)


class Group(_GroupBase[Episode]):
    """A reserved group (sync). ``with group:`` finishes open episodes on exit, abandons all on an error."""

    def __init__(self, gateway: Gateway, group_id: str, task_id: str | None, episodes: list[Episode]) -> None:
        super().__init__(group_id, task_id, episodes)
        self.gateway = gateway

    def finish(self) -> None:
        for episode in self.episodes:
            episode.finish()

    def abandon(self) -> None:
        self.gateway.request("POST", f"/v1/groups/{self.group_id}/abandon")
        for episode in self.episodes:
            if episode.active:
                episode.status = "abandoned"
            episode._close_owned()

    def __enter__(self) -> Group:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        _end_sync(self, exc)


def _end_sync(thing: Episode | Group, exc: BaseException | None) -> None:
    if isinstance(exc, GatewayUnavailable):  # abandoning would wait for the same dead gateway; its timeout cleans up
        return
    try:
        thing.finish() if exc is None else thing.abandon()
    except GatewayError:
        if exc is None:
            raise
        log.warning("could not abandon %r after %r", thing, exc)  # the original error matters more


# ------------------------------------------------------------------------------------------ async


class AsyncGateway:
    """The gateway's session API for asyncio; the same methods as `Gateway`, awaited."""

    def __init__(self, url: str, key: str, *, timeout_s: float = 60.0, down_wait_s: float = 120.0,
                 admission_wait_s: float = 3600.0, http: httpx.AsyncClient | None = None,
                 sdk_http: Any = None) -> None:
        self.url = _check_url(url)
        self.headers = {"Authorization": f"Bearer {key}"}
        self.down_wait_s = down_wait_s
        self.admission_wait_s = admission_wait_s
        self.counters = Counters()
        self._http = http or httpx.AsyncClient(timeout=timeout_s)
        self._owns_http = http is None
        self._sdk_http = sdk_http  # an httpx2.AsyncClient shared by the episodes' AsyncOpenAI clients
        self._model: str | None = None
        self._model_lock = asyncio.Lock()

    async def request(self, method: str, path: str, *, json: Any = None, key: str | None = None,
                      params: dict[str, Any] | None = None) -> httpx.Response:
        """One call with the retry policy of the module docstring; returns the 2xx response."""
        headers = {"Authorization": f"Bearer {key}"} if key else self.headers
        attempts = _Attempts(f"{method} {self.url}{path}", self.down_wait_s, self.admission_wait_s, self.counters)
        while True:
            try:
                response = await self._http.request(method, self.url + path, json=json, headers=headers,
                                                    params=params)
            except httpx.TransportError as exc:
                wait = attempts.next_wait(None, exc)
            else:
                wait = attempts.next_wait(response, None)
                if wait is None:
                    return response
            assert wait is not None
            await asyncio.sleep(wait)

    async def model(self) -> str:
        """The served model's name (first of ``GET /v1/models``), asked once."""
        async with self._model_lock:
            if self._model is None:
                data = (await self.request("GET", "/v1/models")).json().get("data") or []
                if not data:
                    raise GatewayError("GET /v1/models lists no model")
                self._model = str(data[0]["id"])
        return self._model

    def group(self, task_id: str | None = None, size: int = 4, *, group_id: str | None = None,
              metadata: dict[str, Any] | None = None, eval: bool = False) -> _Reservation:
        """Reserve ``size`` episodes of ``task_id`` in one admission decision (waits out 429s).

        ``async with gateway.group(...) as group:`` (finished / abandoned at the end of the block), or
        ``group = await gateway.group(...)`` to manage it yourself.
        """
        return _Reservation(self._reserve(_group_body(task_id, size, group_id, metadata, eval), task_id))

    async def _reserve(self, body: dict[str, Any], task_id: str | None) -> AsyncGroup:
        model = await self.model()
        created = (await self.request("POST", "/v1/groups", json=body)).json()
        episodes = [AsyncEpisode(self, s, group_id=str(created["group_id"]), task_id=task_id, model=model,
                                 async_sdk_http=self._sdk_http) for s in _sessions_of(self.url, created)]
        return AsyncGroup(self, str(created["group_id"]), task_id, episodes)

    async def reward(self, response_id: str, value: float) -> None:
        """Reward one turn by its response id (``response.id``)."""
        await self.request("POST", "/reward", json=_reward_body(value, "", response_id))

    async def group_status(self, group_id: str) -> dict[str, Any]:
        """``GET /v1/groups/{id}``: the group's status and each session's status and reward."""
        return dict((await self.request("GET", f"/v1/groups/{group_id}")).json())

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
        await _end_async(self._group, exc)


class AsyncEpisode(_EpisodeBase):
    """One session of a group (async). ``async with episode:`` finishes it on exit, abandons it on an error."""

    def __init__(self, gateway: AsyncGateway, session: _Session, **kw: Any) -> None:
        super().__init__(session, **kw)
        self.gateway = gateway

    async def reward(self, value: float, *, response_id: str | None = None) -> None:
        """Reward one turn (``response_id``) or, without it, the whole episode."""
        await self.gateway.request("POST", "/reward", json=_reward_body(value, self.session_id, response_id),
                                   key=self.api_key)
        self.rewards.append((response_id, float(value)))

    async def finish(self) -> None:
        """Done: the session waits for the rest of its group, then goes to the trainer. Idempotent."""
        if self.active:
            await self.gateway.request("POST", f"/v1/sessions/{self.session_id}/finish")
            self.status = "finished"
        await self._close_owned()

    async def abandon(self) -> None:
        """Give up: never trained on; its place in the budget is freed."""
        if self.active:
            await self.gateway.request("POST", f"/v1/sessions/{self.session_id}/abandon")
            self.status = "abandoned"
        await self._close_owned()

    async def _close_owned(self) -> None:
        for client in self._owned:
            result = client.close()
            if asyncio.iscoroutine(result):
                await result
        self._owned.clear()

    async def __aenter__(self) -> AsyncEpisode:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await _end_async(self, exc)


class AsyncGroup(_GroupBase[AsyncEpisode]):
    """A reserved group (async). ``async with group:`` finishes open episodes on exit, abandons all on error."""

    def __init__(self, gateway: AsyncGateway, group_id: str, task_id: str | None,
                 episodes: list[AsyncEpisode]) -> None:
        super().__init__(group_id, task_id, episodes)
        self.gateway = gateway

    async def finish(self) -> None:
        for episode in self.episodes:
            await episode.finish()

    async def abandon(self) -> None:
        await self.gateway.request("POST", f"/v1/groups/{self.group_id}/abandon")
        for episode in self.episodes:
            if episode.active:
                episode.status = "abandoned"
            await episode._close_owned()

    async def __aenter__(self) -> AsyncGroup:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await _end_async(self, exc)


async def _end_async(thing: AsyncEpisode | AsyncGroup, exc: BaseException | None) -> None:
    if isinstance(exc, GatewayUnavailable):  # abandoning would wait for the same dead gateway; its timeout cleans up
        return
    try:
        await (thing.finish() if exc is None else thing.abandon())
    except GatewayError:
        if exc is None:
            raise
        log.warning("could not abandon %r after %r", thing, exc)  # the original error matters more
