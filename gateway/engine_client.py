"""The :class:`EngineRouter` over engines: routing, health, and generation held across weight pushes.

The router speaks the engine protocol of :mod:`engines.base` (:class:`~engines.base.Engine`), so it routes
over SGLang-native engines (SGLang, the embedded engine) and vLLM servers alike; each kind's client is in
:mod:`engines` and is bound to the gateway's errors and transports by :mod:`gateway.engines`
(:class:`~gateway.engines.EngineClient` is the SGLang-native one).

The router keeps several engines in rotation: least in-flight requests first, with session affinity (a
session sticks to the engine that served it, so that its prefix cache stays warm), periodic health
checks (a dead engine leaves the rotation and comes back when ``/health`` answers 200 again). An engine that
is alive but busy (its probe timed out: loading weights, say) is waited for, bounded, rather than refused;
an engine this router paused for a weight push stays in rotation while it loads. The router also owns
generation across weight updates: ``pause`` aborts in-flight generations on the engines; the router holds
each aborted request, and on ``resume`` re-sends it as prompt + partial output, so the caller sees one
uninterrupted generation whose tokens carry the weight version of the segment that produced them.

The wire types the gateway's modules use with the router (``SamplingParams``, ``EngineOutput``) and the
SGLang-native client and output parser bound to the gateway's errors (``EngineClient``, ``parse_output``)
are importable from here too, where they have always been.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from engines.base import Engine, EngineOutput, SamplingParams, engine_error, span_versions
from engines.sglang import parse_output as parse_sglang_output
from gateway.engines import GATEWAY_ERRORS, EngineClient
from gateway.errors import EngineError, EngineUnavailable
from gateway.sizedlru import CacheSize

__all__ = ["EngineClient", "EngineOutput", "EngineRouter", "EngineState", "Generation", "SamplingParams",
           "parse_output", "span_versions"]

log = logging.getLogger("agentrl.gateway.engine")


def parse_output(body: dict[str, Any], known: int = 0) -> EngineOutput:
    """One SGLang ``/generate`` answer (or stream chunk), its errors the gateway's."""
    return parse_sglang_output(body, known, GATEWAY_ERRORS)


@dataclass(slots=True)
class Generation:
    """The cumulative state of a generation across segments (abort + resume makes several)."""

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop" | "length" when done
    matched: int | str | None = None
    segments: int = 0
    engine_url: str = ""


@dataclass(slots=True)
class EngineState:
    client: Engine
    healthy: bool = True
    in_flight: int = 0
    served: int = 0
    failures: int = 0
    last_error: str | None = None
    last_check: float = 0.0
    last_output: float = 0.0  # time.monotonic() of the last engine output received for a generation
    busy: bool = False  # its last probe got no answer in time: alive but occupied (loading weights, a long batch)
    # the weight version it reported while below the gateway's (it restarted on older weights): out of rotation
    # while another engine serves the current version (see EngineRouter.check_versions); None when current
    behind: int | None = None

    def as_json(self) -> dict[str, Any]:
        return {"url": self.client.base_url, "kind": self.client.kind, "healthy": self.healthy, "in_flight": self.in_flight,
                "served": self.served, "failures": self.failures, "last_error": self.last_error,
                "last_check": self.last_check, "behind": self.behind}


class EngineRouter:
    """Routes generations over engines and holds them across pause/resume (see the module docstring)."""

    def __init__(self, clients: list[Engine], *, health_interval_s: float = 5.0,
                 affinity_size: int = 100_000, busy_wait_s: float = 60.0) -> None:
        if not clients:
            raise ValueError("EngineRouter needs at least one engine")
        self.engines = [EngineState(c) for c in clients]
        self.health_interval_s = health_interval_s
        # a failed probe of an engine that produced output for an in-flight request this recently is
        # not taken as down (see check_health)
        self.busy_window_s = health_interval_s + 10.0
        # how long a request waits for a busy engine (one whose probe timed out: loading weights, say) to
        # answer again when no engine is in rotation, before it gets 503
        self.busy_wait_s = busy_wait_s
        self._probe: asyncio.Task[None] | None = None  # the health check waiting requests share
        self._affinity: OrderedDict[str, int] = OrderedDict()
        self._affinity_size = affinity_size
        self._running = asyncio.Event()
        self._running.set()
        self._pause_epoch = 0
        self._pause_mode: str | None = None  # the mode of the pause in force (None while running)
        self._owes_continue: set[int] = set()  # engines paused by this router and not yet continued
        self.weight_version = 0
        self.held = 0  # generations waiting for resume
        self.version_mismatches = 0  # segments whose engine reported a different weight version
        self.behind_engines = 0  # times an engine was found serving a version below the gateway's (a restart)
        # Asked before an unexplained abort is called an error: did another replica pause (control plane)?
        self.pause_check: Callable[[], Awaitable[bool]] | None = None
        self._health_task: asyncio.Task[None] | None = None

    # ---- lifecycle and health ----
    async def start(self) -> None:
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop(), name="engine-health")

    async def close(self) -> None:
        for task in (self._health_task, self._probe):
            if task is not None and not task.done():
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.check_health()

    async def check_health(self) -> None:
        """Probe every engine. An engine this router paused is probed for liveness only (SGLang's
        ``/health`` cannot answer behind a pause); one that still owes a ``continue_generation`` (resume
        could not reach it) gets it again first, once the router is no longer paused."""
        if not self.paused and self._owes_continue:
            await self._continue(sorted(self._owes_continue))
        pushing = {i for i in self._owes_continue if self.paused}
        epoch, expected = self._pause_epoch, self.weight_version
        results = await asyncio.gather(*(
            e.client.health(paused=i in pushing) for i, e in enumerate(self.engines)))
        versions = await self._versions([bool(r) and not self.paused for r in results])
        now = time.monotonic()
        for i, (state, answer) in enumerate(zip(self.engines, results)):
            state.busy = answer is None
            ok = bool(answer)
            if answer is None and i in pushing and state.healthy:
                # paused by this router for a weight push: an engine loading weights may not answer even
                # its liveness route in time; it is not taken out of rotation for that (resume's
                # continue_generation tells whether it came back; a refused connection still counts)
                log.info("engine %s did not answer its liveness probe while paused (loading weights?): kept",
                         state.client.base_url)
                ok = True
            if not ok and state.healthy and state.in_flight and now - state.last_output < self.busy_window_s:
                # SGLang's /health is a generation queued behind the running batch: an engine busy with many
                # requests can miss the probe's 5 s while it is visibly producing output for us. Taking it
                # out of rotation for that turned load into 503s; a dead engine breaks its streams instead
                # (_mark_failed), and a hung one stops producing output and fails the next probe.
                log.info("engine %s missed a health probe while busy (%d in flight, output %.1f s ago): kept",
                         state.client.base_url, state.in_flight, now - state.last_output)
                ok = True
            if ok != state.healthy:
                log.warning("engine %s is now %s", state.client.base_url, "healthy" if ok else "unhealthy")
            state.healthy = ok
            state.last_check = time.time()
            if ok:
                state.last_error = None
        if not self.paused and self._pause_epoch == epoch and self.weight_version == expected:
            self.check_versions(versions, expected)

    async def _versions(self, ask: list[bool]) -> list[int | None]:
        """The weight version each engine reports (``/model_info``; vLLM's ``/weight_info``) where ``ask``
        says so; None where not asked, where the engine reports none, or where the question failed."""

        async def one(state: EngineState) -> int | None:
            try:
                return await state.client.weight_version()
            except Exception:  # noqa: BLE001 - no answer is no evidence: the health probe decides liveness
                return None

        answers = await asyncio.gather(*(one(e) if a else _none() for e, a in zip(self.engines, ask)))
        return list(answers)

    def check_versions(self, versions: list[int | None], expected: int) -> None:
        """Take out of rotation an engine whose weight version went below the gateway's ``expected`` (it
        restarted and serves its base weights as version 0, say) while another engine in rotation serves
        ``expected``; it comes back once it reports ``expected`` again (the trainer's next push reaches every
        engine the gateway lists, in rotation or not; the trainer also pushes again when it finds one behind
        while it waits for data). With no engine at ``expected`` the ones behind stay in rotation (refusing
        every request would also stop the data the trainer needs to push again); their tokens carry the
        version they report, which is what sampled them."""
        current = [i for i, v in enumerate(versions) if v is not None and v >= expected and self.engines[i].healthy]
        for i, (state, version) in enumerate(zip(self.engines, versions)):
            if version is None:
                continue
            if version >= expected:
                if state.behind is not None:
                    log.warning("engine %s serves weight version %d again: back in rotation", state.client.base_url,
                                version)
                    state.behind = None
                continue
            if state.behind is None:
                self.behind_engines += 1
                log.warning("engine %s serves weight version %d, below the gateway's %d (restarted on older "
                            "weights?): %s", state.client.base_url, version, expected,
                            "out of rotation until a push brings it up" if current else
                            "kept in rotation, no engine serves the current version (its tokens carry its version)")
            state.behind = version
            if current and state.healthy:
                state.healthy = False
                state.last_error = (f"serves weight version {version}, below the gateway's {expected}: out of "
                                    "rotation until a weight push brings it up")

    async def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            await self.check_health()
            if any(e.healthy for e in self.engines):
                return
            if time.monotonic() > deadline:
                raise EngineUnavailable(
                    f"no engine became healthy within {timeout_s:.0f}s: "
                    + ", ".join(e.client.base_url for e in self.engines))
            await asyncio.sleep(0.5)

    def healthy_engine(self) -> Engine:
        for state in self.engines:
            if state.healthy:
                return state.client
        raise EngineUnavailable("no healthy engine")

    def _mark_failed(self, state: EngineState, exc: Exception) -> None:
        state.failures += 1
        state.healthy = False
        state.last_error = str(exc)
        log.warning("engine %s taken out of rotation: %s", state.client.base_url, exc)

    # ---- routing ----
    def pick(self, affinity_key: str | None, exclude: set[int] | None = None) -> int:
        """Index of the engine for a request: the session's engine if healthy, else the least loaded."""
        exclude = exclude or set()
        if affinity_key is not None and affinity_key in self._affinity:
            index = self._affinity[affinity_key]
            if self.engines[index].healthy and index not in exclude:
                self._affinity.move_to_end(affinity_key)
                return index
        candidates = [i for i, e in enumerate(self.engines) if e.healthy and i not in exclude]
        if not candidates:
            raise EngineUnavailable(
                "no healthy engine to serve the request (checked: "
                + ", ".join(e.client.base_url for e in self.engines) + ")")
        index = min(candidates, key=lambda i: (self.engines[i].in_flight, self.engines[i].served))
        if affinity_key is not None:
            self._affinity[affinity_key] = index
            self._affinity.move_to_end(affinity_key)
            while len(self._affinity) > self._affinity_size:
                self._affinity.popitem(last=False)
        return index

    async def _pick_or_wait(self, affinity_key: str | None, exclude: set[int]) -> int:
        """:meth:`pick`; when no engine is in rotation but one is busy (alive, but its probe timed out: the
        only engine loading weights, say), the request waits for it, re-probing, up to ``busy_wait_s``.
        Engines that refused the connection are not waited for: 503 at once, as before."""
        try:
            return self.pick(affinity_key, exclude)
        except EngineUnavailable:
            if not any(e.busy for i, e in enumerate(self.engines) if i not in exclude):
                raise
        deadline = time.monotonic() + self.busy_wait_s
        while True:
            if self._probe is None or self._probe.done():
                self._probe = asyncio.create_task(self.check_health(), name="engine-probe")
            await asyncio.shield(self._probe)
            try:
                return self.pick(affinity_key, exclude)
            except EngineUnavailable:
                waiting = any(e.busy for i, e in enumerate(self.engines) if i not in exclude)
                if not waiting or time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(min(0.5, self.health_interval_s))

    def cache_sizes(self) -> list[CacheSize]:
        """The session -> engine affinity map."""
        return [CacheSize("engine_affinity", len(self._affinity), len(self._affinity), self._affinity_size)]

    # ---- pause / resume ----
    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    async def pause(self, mode: str = "abort") -> None:
        """Stop generation on every engine; in-flight generations are aborted and held until resume.

        Every engine sent a pause owes a ``continue_generation``, whatever its health afterwards: SGLang
        stays paused until told otherwise. An engine that cannot be reached leaves the rotation; any other
        refusal (a bad ``mode``) is raised once every engine has been tried.

        An ``abort`` pause while this router holds the engines in an ``in_place`` or ``retract`` pause (an
        operator's, before a push) first continues them, so that the abort reaches their schedulers and
        empties them: a push flushes the prefix cache with the update, which SGLang accepts only from an
        idle scheduler (0.5.19 asserts and dies otherwise, 0.5.23 answers 400). Their requests end as
        aborted and are held and re-sent after resume, like every other."""
        if mode == "abort" and self.paused and self._pause_mode in ("in_place", "retract") and self._owes_continue:
            log.info("abort pause over a %s pause: continuing the engines first so that they empty",
                     self._pause_mode)
            await self._continue(sorted(self._owes_continue))
        self._pause_mode = mode
        self._pause_epoch += 1
        self._running.clear()
        targets = [i for i, e in enumerate(self.engines) if e.healthy]
        self._owes_continue.update(targets)
        results = await asyncio.gather(*(self.engines[i].client.pause(mode) for i in targets),
                                       return_exceptions=True)
        refused: BaseException | None = None
        for i, result in zip(targets, results):
            if isinstance(result, EngineUnavailable):
                self._mark_failed(self.engines[i], result)
            elif isinstance(result, BaseException) and refused is None:
                refused = result
        if refused is not None:
            raise refused

    async def resume(self, weight_version: int) -> None:
        """Set the weight version, let engines generate again, and re-send every held generation.

        ``continue_generation`` goes to every engine this router paused, healthy or not (a paused SGLang
        fails its health probe, so health cannot decide who to resume), and to every healthy one. An engine
        that cannot be reached keeps owing it; the health loop sends it again until it lands."""
        self.weight_version = weight_version
        self._pause_mode = None
        targets = sorted(self._owes_continue | {i for i, e in enumerate(self.engines) if e.healthy})
        self._owes_continue.update(targets)
        try:
            await self._continue(targets)
        finally:  # held generations go on even if a continue failed or this call was cancelled
            self._running.set()

    async def _continue(self, targets: list[int]) -> None:
        results = await asyncio.gather(*(self.engines[i].client.continue_generation() for i in targets),
                                       return_exceptions=True)
        for i, result in zip(targets, results):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result  # cancellation and friends
                self._mark_failed(self.engines[i], result)
            else:
                self._owes_continue.discard(i)
                state = self.engines[i]
                if not state.healthy:  # it answered: back in rotation now, not at the next probe
                    log.warning("engine %s is now healthy (generation continued)", state.client.base_url)
                state.healthy, state.busy, state.last_error = True, False, None

    # ---- generation ----
    async def generate(
        self, input_ids: list[int], params: SamplingParams, *, affinity_key: str | None, stream: bool
    ) -> AsyncIterator[Generation]:
        """Yield the cumulative :class:`Generation` as tokens arrive (once per segment without ``stream``).

        The last item has ``finish`` set. An abort caused by a pause (or an engine lost mid-generation
        while another is healthy) is invisible here: the partial output is kept and generation continues
        from prompt + partial output after resume, each segment's tokens tagged with its weight version.
        """
        gen = Generation()
        excluded: set[int] = set()
        while True:
            remaining = params.max_new_tokens - len(gen.output_ids)
            if remaining <= 0:
                gen.finish = "length"
                yield gen
                return
            if not self._running.is_set():
                self.held += 1
                try:
                    await self._running.wait()
                finally:
                    self.held -= 1
            epoch = self._pause_epoch
            index = await self._pick_or_wait(affinity_key, excluded)
            state = self.engines[index]
            gen.engine_url = state.client.base_url
            gen.segments += 1
            base = len(gen.output_ids)
            segment_version = self.weight_version
            segment_ids = input_ids + gen.output_ids if base else input_ids
            segment_params = params.continued(base)
            state.in_flight += 1
            last: EngineOutput | None = None
            try:
                if stream:
                    async for out in state.client.generate_stream(segment_ids, segment_params, remaining):
                        last = out
                        state.last_output = time.monotonic()
                        self._merge(gen, base, out, segment_version)
                        if out.finish is None or out.finish != "abort":
                            yield gen
                else:
                    last = await state.client.generate(segment_ids, segment_params, remaining)
                    state.last_output = time.monotonic()
                    self._merge(gen, base, last, segment_version)
            except EngineUnavailable as exc:
                self._mark_failed(state, exc)
                excluded.add(index)
                if not any(e.healthy for i, e in enumerate(self.engines) if i not in excluded):
                    raise
                _restart_constrained(gen, params, stream)
                continue  # another engine continues from prompt + partial output
            finally:
                state.in_flight -= 1
                state.served += 1
            if last is None:
                raise EngineError(f"engine {state.client.base_url} closed the stream without output")
            if last.finish == "abort":
                if last.abort_status is not None:  # a refusal (SGLang streams it as an abort chunk)
                    raise engine_error(GATEWAY_ERRORS, state.client.base_url, last.abort_status,
                                       last.abort_message or "aborted")
                if self.paused or self._pause_epoch != epoch or (
                        self.pause_check is not None and await self.pause_check()):
                    _restart_constrained(gen, params, stream)
                    continue  # held: resent after resume
                raise EngineError(f"engine {state.client.base_url} aborted the generation")
            if last.finish not in ("stop", "length"):
                raise EngineError(f"engine {state.client.base_url} ended with finish_reason {last.finish!r}")
            gen.finish = last.finish
            gen.matched = last.matched
            if not stream:
                yield gen
            return

    def _merge(self, gen: Generation, base: int, out: EngineOutput, version: int) -> None:
        # A segment's tokens carry the weight version the engine reports for it (SGLang and the embedded
        # engine report the version their weights were pushed with): that is what sampled them, whatever
        # this replica was told. An engine that reports none (SGLang's "default") gets the gateway's
        # version at the time the segment was sent (set on resume after a push). Disagreements are counted.
        # A finished segment's per-token versions (``weight_versions`` spans) win: a request an engine held
        # across a push (retract / in_place pause without the gateway) has tokens of both versions.
        if out.weight_version is not None and out.weight_version != version:
            self.version_mismatches += 1
            version = out.weight_version
        # ``out`` starts at output position ``out.start`` of this segment (its earlier tokens are merged)
        keep = base + out.start
        del gen.output_ids[keep:], gen.logprobs[keep:], gen.versions[keep:], gen.top_logprobs[keep:]
        gen.output_ids.extend(out.output_ids)
        gen.logprobs.extend(out.logprobs)
        gen.versions.extend(out.versions if out.versions is not None else [version] * len(out.output_ids))
        if out.top_logprobs is not None:
            gen.top_logprobs.extend(out.top_logprobs)


async def _none() -> None:
    return None


def _restart_constrained(gen: Generation, params: SamplingParams, stream: bool) -> None:
    """A grammar-constrained generation cannot continue from prompt + partial output (the engine would start
    the grammar over inside the output): without streaming its partial output is dropped and it starts over
    (all of it then sampled under the new weights); a stream whose tokens were already sent fails."""
    if not params.grammar or not gen.output_ids:
        return
    if stream:
        raise EngineError("a grammar-constrained stream was interrupted (weight update or engine lost) after "
                          "it had sent tokens and cannot continue under its grammar; retry the request")
    del gen.output_ids[:], gen.logprobs[:], gen.versions[:], gen.top_logprobs[:]
