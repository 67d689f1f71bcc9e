"""The conversation core: from a parsed request to recorded turns, whatever wire format it came in.

Wire formats (``gateway.formats``: chat completions, Responses, Messages) parse their requests into the
core's model (``ChatCompletionRequest``; ``CompletionRequest`` for raw prompts) and render what
:meth:`GenerationService.run_turn` returns (the plan and finished choices) or what
:meth:`GenerationService.stream_turn` yields (:class:`TurnEvent`: ``delta``, ``end``, ``recorded``). The
core never renders a response. For a conversation turn:

1. validate ``messages``/``tools`` (chat layer; 400 with the JSON path of the bad value);
2. bind the session (``gateway.binding``) and find the parent turn: the longest prefix of the messages
   that ends in an assistant message and equals a recorded turn's messages + returned message (hash chain,
   one index probe per candidate);
3. build the prompt token-exact: for a child, the parent's full token sequence + the chat layer's
   continuation (bridge end-of-turn token if the parent was cut + the newly rendered messages); for a root,
   the template's rendering; count roots by reason and template drift;
4. generate every choice on the engines (``gateway.engine_client.EngineRouter``: routing, pause/resume);
5. decode (``gateway.decoding``: stop strings, tool calls, logprobs);
6. record every choice as its own interaction in ONE store call (group commit, all or nothing) and only
   then return (or, when streaming, yield ``recorded``, after which the format sends its final events).

From the moment its session is known until it is recorded or fails, a turn is reported to the lifecycle
(``Services.inflight``, see ``gateway.lifecycle.InFlight``), so that its session is never idle-finished or
exported under it, also while the turn is held during a weight-sync pause.

Nothing is recorded for a request that fails before step 6 (bad input, engine down), so no partial rows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import logging
import random
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gateway.binding import KeyedSession, group_of_root, session_of_key
from gateway.chat.errors import ChatFormatError, TemplateDriftError
from gateway.chat.normalize import canonical_json, chain_hashes, extend_chain, validate_messages
from gateway.constraints import check_grammar, grammar_of, penalties, penalties_json, refuse_unenforced
from gateway.context import Services
from gateway.decoding import ChoiceDecoder, ChoiceResult, StreamDelta
from gateway.engine_client import Generation, SamplingParams
from gateway.errors import (
    Conflict,
    ContextLengthExceeded,
    GatewayError,
    InvalidRequest,
    from_chat_error,
    from_store_error,
)
from gateway.store import Continued, Interaction, NewSession, SessionRecord
from gateway.store import errors as store_errors
from gateway.wire import ChatCompletionRequest, CompletionRequest, SamplingFields

log = logging.getLogger("agentrl.gateway.service")
T = TypeVar("T")


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def new_id(prefix: str) -> str:
    """A fresh response id: ``chatcmpl-<hex>``; a prefix ending in ``_`` is used as is (``resp_<hex>``)."""
    sep = "" if prefix.endswith("_") else "-"
    return f"{prefix}{sep}{secrets.token_hex(12)}"


@dataclass
class TurnPlan:
    """Where a new turn goes in the tree and the exact prompt it is generated from."""

    session: SessionRecord | None  # None: a new implicit episode per choice (created when recording)
    parent: Interaction | None
    prompt: list[int]  # the whole prompt sent to the engine
    recorded_prompt: list[int]  # what the store keeps: the delta beyond the parent (all of it for a root)
    bridge_len: int
    root_reason: str | None
    request: dict[str, Any]  # recorded request: new messages + tools + params
    request_hash: str
    group_id: str | None = None  # implicit episodes: hash of the root prompt
    implicit: bool = False
    charged: int = 0  # sessions charged to the staleness budget for new implicit episodes (one per choice)
    handed: int = 0  # of those, sessions created (they keep their charge; the rest is given back)
    tracked: bool = False  # the in-flight marker of ``session`` was added with its lookup (and is held)
    timings: dict[str, float] = field(default_factory=dict)
    # checks that do not change the prompt (the sampled drift check), run while the engine generates
    checks: list[Callable[[], Awaitable[None]]] = field(default_factory=list)


@dataclass
class Ahead:
    """The continuation's delta (``ChatTemplate.delta``) for a parent at ``prefix_len``, computed while the
    parent lookup was out; ``result`` is the exception it raised, if it did (raised again if used)."""

    prefix_len: int
    result: tuple[int, list[int]] | Exception

    def delta(self) -> tuple[int, list[int]]:
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


@dataclass
class TurnEvent:
    """One step of a streamed turn, before any wire format renders it.

    ``delta``: a choice released text / tool calls (``delta``, with ``gen`` the cumulative engine output);
    ``end``: a choice finished (its last delta; ``run.result`` is set); ``recorded``: every choice is
    committed to the store (the stream may now send its final events)."""

    kind: str  # "delta" | "end" | "recorded"
    run: ChoiceRun | None = None
    delta: StreamDelta | None = None
    gen: Generation | None = None


@dataclass
class ChoiceRun:
    index: int
    id: str
    seed: int | None
    decoder: ChoiceDecoder
    result: ChoiceResult | None = None
    engine_s: float = 0.0


def _ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1000.0, 3)


class Turn(AsyncExitStack):
    """What a turn holds until it ends, released when it closes, and the Redis members of the in-flight
    markers it holds (``markers``): when the turn is recorded, their removal rides on the publish that
    follows the commit (``InFlight.releases``) instead of a Redis command of its own after the answer."""

    def __init__(self) -> None:
        super().__init__()
        self.markers: list[str] = []

    async def hold(self, marked: AbstractAsyncContextManager[str | None]) -> None:
        """Enter ``InFlight.track`` / ``adopt`` for the rest of the turn and keep the member it yields."""
        member = await self.enter_async_context(marked)
        if member is not None:
            self.markers.append(member)


class GenerationService:
    def __init__(self, svc: Services, *, owner: str | None = None) -> None:
        self.svc = svc
        self.owner = owner  # the caller's fingerprint: implicit episodes are created under it and only
        #                     continued by the same key (``gateway.binding.owns``)

    # ------------------------------------------------------------------------------------ in flight
    async def _track(self, turn: Turn, session: SessionRecord | None) -> None:
        """Report a turn of ``session`` in flight until ``turn`` closes (no-op for an implicit episode
        not created yet)."""
        if session is not None:
            await turn.hold(self.svc.inflight.track(session.id))

    async def _track_planned(self, turn: Turn, given: SessionRecord | KeyedSession | None, plan: TurnPlan) -> None:
        """Also track the session planning found (an implicit-mode continuation), unless its marker was
        added with the lookup that found it."""
        if plan.session is not None and not plan.tracked and (given is None or plan.session.id != given.id):
            await self._track(turn, plan.session)

    async def _planned(self, turn: Turn, plan: TurnPlan) -> None:
        """When ``turn`` closes, give back the budget charged for implicit episodes that were never created
        (the engine failed, the context was too long, the client went away, the store refused)."""
        async def give_back() -> None:
            unused = plan.charged - plan.handed
            if unused > 0:
                plan.charged = plan.handed
                await self.svc.admission.release(unused)
        turn.push_async_callback(give_back)

    # ------------------------------------------------------------------------------------ planning
    async def _find_parent(self, session_id: str, candidates: list[tuple[int, str]],
                           indexed: Continued | None) -> Any:
        try:
            return await self.svc.store.find_parent(session_id=session_id, candidates=candidates, indexed=indexed)
        except store_errors.StoreError as exc:
            raise from_store_error(exc) from exc

    async def _continued(self, turn: Turn, hashes: list[str]) -> Continued | None:
        """The implicit episode this turn continues (its session active and created under this caller's
        key), else None: a new root. With Redis, one round trip also brings the parent index's entry and
        adds the turn's in-flight marker, which ``turn`` then holds (``plan.tracked``)."""
        inflight = self.svc.inflight
        marker = inflight.marker()
        try:
            hit = await self.svc.implicit.lookup(hashes, marker)
            if hit is None:
                return None
            record = hit.record
            if record is None:
                try:
                    record = await self.svc.store.get_session(session_id=hit.session_id, cached=True)
                except store_errors.NotFound:
                    return None
        except store_errors.StoreError as exc:
            raise from_store_error(exc) from exc
        # another key's identical conversation is not continued: a new root
        continued = record.status == "active" and (record.metadata or {}).get("owner") == self.owner
        if hit.marked and marker is not None:
            if continued:
                await turn.hold(inflight.adopt(hit.session_id, marker.member))
            else:
                inflight.discard(hit.session_id, marker.member)
        return dataclasses.replace(hit, record=record) if continued else None

    async def _resolve(self, session: SessionRecord | KeyedSession | None) -> SessionRecord | None:
        """The record of a session known by its key only (``gateway.binding.authenticate``'s ``defer``)."""
        if not isinstance(session, KeyedSession):
            return session
        return await session_of_key(self.svc.store, session.api_key)

    async def _named(self, turn: Turn, session: SessionRecord | KeyedSession, hashes: list[str]) -> Continued | None:
        """Track a turn of a named session (session key or URL). With Redis its in-flight marker, the parent
        index's entry for the longest candidate (``hashes[0]``; none for a first turn) and, for a session
        known by its key only, the session's record come in one round trip (``plan.tracked``); the result
        carries the record. Without Redis: the marker alone, and None (or, for a :class:`KeyedSession`,
        its record read from the store)."""
        inflight = self.svc.inflight
        marker = inflight.marker()
        hit = None
        if marker is not None:
            known = session if isinstance(session, SessionRecord) else None
            try:
                hit = await self.svc.store.mark_session(session_id=session.id, longest_hash=hashes[0] if hashes else None,
                                                        marker=marker, record=known)
            except store_errors.StoreError as exc:
                raise from_store_error(exc) from exc
        if hit is None:  # no Redis
            record = await self._resolve(session)
            assert record is not None
            await self._track(turn, record)
            return Continued(record.id, record, None, False) if record is not session else None
        await turn.hold(inflight.adopt(session.id, marker.member))  # held first: a 401 below removes it
        if hit.record is None:  # not cached in Redis: read (and cached) by key, 401 if the key is unknown
            hit = dataclasses.replace(hit, record=await self._resolve(session))
        return hit

    def _refuse_surely_too_long(self, messages: Any, tools: Any) -> int:
        """Refuse, before rendering anything, input that cannot fit the context: no token decodes to more
        than the vocabulary's longest token string, so ``chars / longest`` is a lower bound on its tokens
        (a prompt of megabytes used to freeze the event loop while it was rendered and tokenized)."""
        chars = _text_chars(messages) + _text_chars(tools)
        tokens_at_least = chars // _longest_token(self.svc.tokenizer)
        if tokens_at_least >= self.svc.context_length:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {self.svc.context_length} tokens; the messages hold "
                f"{chars} characters, at least {tokens_at_least} tokens. Shorten the conversation.",
                param="messages")
        return chars

    async def _refuse_too_many_tokens(self, messages: Any, tools: Any, chars: int) -> None:
        """Refuse a conversation of more than ``OFF_LOOP_CHARS`` whose rendering has more tokens than the
        context, before the prompt's ids are built: the count is the fast tokenizer's own (its Rust
        ``encode_batch`` releases the interpreter lock), where building the ids of a 7.9 MB prompt (3.2 M
        tokens) as Python lists held the lock for ~105 ms and so stalled the event loop (issue 36). The
        margin keeps a prompt stitched from its parent's tokens (which may differ from the rendering by a
        few tokens, as may the count's cuts, ``_count_tokens``) out of this shortcut; it is checked exactly once
        built."""
        count = await _off_loop(_count_tokens, self.svc.template, self.svc.tokenizer, messages, tools or None,
                                chars=chars)
        ctx = self.svc.context_length
        if count is not None and count >= ctx + TOKEN_COUNT_MARGIN:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {ctx} tokens; the messages have {count} tokens. "
                "Shorten the conversation.", param="messages")

    async def plan_chat(self, req: ChatCompletionRequest, session: SessionRecord | KeyedSession | None,
                        turn: Turn) -> TurnPlan:
        started = time.perf_counter()
        # a conversation of megabytes is validated, counted in tokens and hashed off the event loop
        big = _text_chars(req.messages) + _text_chars(req.tools) > OFF_LOOP_CHARS
        try:
            if big:
                await asyncio.to_thread(validate_messages, req.messages, req.tools)
            else:
                validate_messages(req.messages, req.tools)
        except ChatFormatError as exc:
            raise from_chat_error(exc) from exc
        messages: list[dict[str, Any]] = req.messages
        chars = self._refuse_surely_too_long(messages, req.tools)
        if big:
            await self._refuse_too_many_tokens(messages, req.tools, chars)
        hashes = await asyncio.to_thread(chain_hashes, messages) if big else chain_hashes(messages)
        candidates = [(k, hashes[k - 1]) for k in range(len(messages) - 1, 0, -1)
                      if messages[k - 1].get("role") == "assistant"]
        implicit = session is None
        longest_first = [h for _, h in candidates]
        lookup = self._named(turn, session, longest_first) if session is not None \
            else self._continued(turn, longest_first) if candidates else None
        ahead: Ahead | None = None
        if lookup is not None and candidates and self.svc.store.redis is not None:
            lookup, ahead = await self._ahead(lookup, messages, candidates[0][0], req.tools or None, chars)
        continued = await lookup if lookup is not None else None
        if continued is not None:  # the implicit episode found, or the named session's record as just read
            session = continued.record
        if session is not None and session.status != "active":
            raise Conflict(f"session {session.id} is {session.status}; it takes no more turns",
                           code="session_not_active")
        match = await self._find_parent(session.id, candidates, continued) \
            if session is not None and candidates else None
        plan = await self._stitch(req, messages, match, candidates, chars, ahead)
        plan.session = session
        plan.tracked = continued is not None and continued.marked
        plan.implicit = implicit
        plan.request_hash = hashes[-1]
        if session is None:
            plan.group_id = group_of_root(hashes[-1], req.tools)
            plan.charged = await self.svc.admission.reserve(req.n)
        plan.timings["plan_ms"] = _ms(started)
        return plan

    async def _ahead(self, lookup: Awaitable[Continued | None], messages: list[dict[str, Any]], prefix_len: int,
                     tools: Any, chars: int) -> tuple[Awaitable[Continued | None], Ahead | None]:
        """Start the parent lookup (a Redis round trip) and, while it is out, compute the continuation's
        delta for the likeliest parent, the last assistant message (``_stitch`` uses it when the lookup
        agrees): the render overlaps the wait instead of following it. Only for a conversation that would
        be rendered on the loop anyway. Returns the lookup to await."""
        if chars > INLINE_RENDER_CHARS or _tokenize_jobs:
            return lookup, None
        task = asyncio.ensure_future(lookup)
        try:
            await asyncio.sleep(0)  # the task sends its command
        except BaseException:
            await _cancel([task])
            raise
        result: tuple[int, list[int]] | Exception
        try:
            result = self.svc.template.delta(messages[:prefix_len], messages[prefix_len:], tools)
        except Exception as exc:  # raised again only if the turn continues that parent (_stitch)
            result = exc
        return task, Ahead(prefix_len, result)

    async def _stitch(self, req: ChatCompletionRequest, messages: list[dict[str, Any]], match: Any,
                      candidates: list[tuple[int, str]], chars: int, ahead: Ahead | None = None) -> TurnPlan:
        template, metrics = self.svc.template, self.svc.metrics
        tools = req.tools or None
        params = self._params_json(req)
        if match is not None:
            parent: Interaction = match.interaction
            history, new = messages[: match.prefix_len], messages[match.prefix_len:]
            parent_tools = parent.request.get("tools") or None
            reason = None
            if canonical_json(parent_tools) != canonical_json(tools):
                reason = "tools_changed"
            else:
                try:
                    if ahead is not None and ahead.prefix_len == match.prefix_len:
                        cont = template.continuation(history, new, tools, parent.output_ids, delta=ahead.delta())
                    else:
                        cont = await _off_loop(template.continuation, history, new, tools, parent.output_ids,
                                               parent.finish_reason, chars=chars)
                except TemplateDriftError as exc:
                    reason = "template_drift"
                    metrics.drift.labels(exc.reason).inc()
            if reason is None:
                try:
                    full = await self.svc.store.full_sequence(interaction_id=parent.id)
                except store_errors.StoreError as exc:
                    raise from_store_error(exc) from exc
                request = {"messages": new, "tools": tools, "tool_choice": req.tool_choice,
                           "prefix_len": match.prefix_len, "params": params}
                plan = TurnPlan(None, parent, full + cont.prompt_ids, cont.prompt_ids, len(cont.bridge_ids),
                                None, request, "")
                if _sample_drift(len(history), self.svc.settings.drift_check_messages):
                    plan.checks.append(functools.partial(self._check_drift, full, history, tools, new, chars))
                return plan
            root_reason = reason
        else:
            root_reason = "first_turn" if not candidates else "no_prefix_match"
        prompt = await _off_loop(template.render, messages, tools, chars=chars)
        request = {"messages": messages, "tools": tools, "tool_choice": req.tool_choice, "prefix_len": 0,
                   "params": params}
        return TurnPlan(None, None, prompt, prompt, 0, root_reason, request, "")

    async def _check_drift(self, full: list[int], history: list[dict[str, Any]], tools: Any,
                           new: list[dict[str, Any]], chars: int) -> None:
        """Count whether the template's re-render of the history differs from the stitched tokens (the
        prompt is the stitched one either way)."""
        self.svc.metrics.drift_checks.inc()
        if await _off_loop(self.svc.template.drift, full, history, tools, new, chars=chars):
            self.svc.metrics.drift.labels("rerender_differs").inc()

    @staticmethod
    async def _while_generating(plan: TurnPlan) -> None:
        """Run the plan's checks once the engine calls are under way: one pass of the loop lets each
        generation task send its request, so a check's CPU overlaps the engine's work instead of
        preceding it."""
        if plan.checks:
            await asyncio.sleep(0)
            for check in plan.checks:
                await check()

    @staticmethod
    def _params_json(req: SamplingFields) -> dict[str, Any]:
        return {**req.model_dump(include={"n", "temperature", "top_p", "top_k", "seed", "stop", "max_tokens",
                                          "max_completion_tokens", "logprobs", "top_logprobs"},
                                 exclude_none=True),
                **penalties_json(req)}

    def _sampling(self, req: SamplingFields, prompt_len: int, top_logprobs: int) -> SamplingParams:
        ctx = self.svc.context_length
        if prompt_len >= ctx:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {ctx} tokens; the prompt has {prompt_len} tokens. "
                "Shorten the conversation.", param="messages")
        room = ctx - prompt_len
        limit = getattr(req, "token_limit", None) or req.max_tokens or self.svc.settings.default_max_tokens or room
        return SamplingParams(
            max_new_tokens=min(limit, room),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k if req.top_k is not None and req.top_k > 0 else -1,
            seed=req.seed,
            stop=req.stop_list,
            stop_token_ids=self.svc.template.stop_token_ids,
            top_logprobs=top_logprobs,
            penalties=penalties(req),
        )

    def _choices(self, req: SamplingFields, prefix: str, parse_tools: bool) -> list[ChoiceRun]:
        if req.n > self.svc.settings.max_n:
            raise InvalidRequest(f"n must be at most {self.svc.settings.max_n}", param="n")
        return [
            ChoiceRun(i, new_id(prefix), None if req.seed is None else req.seed + i,
                      ChoiceDecoder(self.svc.tokenizer, stop=req.stop_list,
                                    stop_token_ids=self.svc.template.stop_token_ids, parse_tools=parse_tools))
            for i in range(req.n)
        ]

    # ------------------------------------------------------------------------------------ generation
    def _affinity(self, plan: TurnPlan) -> str | None:
        if plan.session is not None:
            return plan.session.id
        return plan.group_id

    async def _generate(self, plan: TurnPlan, params: SamplingParams, run: ChoiceRun) -> ChoiceResult:
        started = time.perf_counter()
        choice_params = _with_seed(params, run.seed)
        last: Generation | None = None
        async for gen in self.svc.router.generate(plan.prompt, choice_params, affinity_key=self._affinity(plan),
                                                  stream=False):
            last = gen
        assert last is not None
        run.engine_s = time.perf_counter() - started
        run.result = run.decoder.finish(last)
        return run.result

    async def _generate_all(self, plan: TurnPlan, params: SamplingParams, runs: list[ChoiceRun]) -> None:
        tasks = [asyncio.ensure_future(self._generate(plan, params, r)) for r in runs]
        try:
            await self._while_generating(plan)
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    # ------------------------------------------------------------------------------------ recording
    async def _record(self, plan: TurnPlan, runs: list[ChoiceRun], chain: Callable[[ChoiceRun], str],
                      turn: Turn) -> None:
        store, metrics = self.svc.store, self.svc.metrics
        inflight = self.svc.inflight
        started = time.perf_counter()
        try:
            sessions: list[str] = []
            created: list[NewSession] = []  # new implicit episodes: created in the turns' own commit
            for _ in runs:
                if plan.session is not None:
                    sessions.append(plan.session.id)
                else:
                    created.append(store.new_session(group_id=plan.group_id,
                                                     metadata={"implicit": True, "owner": self.owner}))
                    sessions.append(created[-1].id)
            rows = []
            for run, sid in zip(runs, sessions):
                res = run.result
                assert res is not None
                request = dict(plan.request)
                request["params"] = {**plan.request["params"], **({"seed": run.seed} if run.seed is not None else {})}
                # the choices of one request share this (siblings, all trained); a re-sent request does not
                request["request_id"] = runs[0].id
                rows.append(Interaction(
                    id=run.id, session_id=sid, parent_id=plan.parent.id if plan.parent else None,
                    request=request, response_message=res.message(), prompt_ids=plan.recorded_prompt,
                    output_ids=res.output_ids, output_logprobs=res.logprobs, output_versions=res.versions,
                    finish_reason=res.finish_reason, chain_hash=chain(run), request_hash=plan.request_hash,
                    bridge_len=plan.bridge_len, root_reason=plan.root_reason,
                    timings={**plan.timings, "engine_ms": round(run.engine_s * 1000.0, 3),
                             "segments": float(res.segments)},
                ))
            # implicit episodes: with Redis the index entries are set with the turns' own after the commit
            index = [(row.chain_hash, row.session_id) for row in rows] if plan.implicit else []
            published = self.svc.implicit.redis_entries(index)
            release = inflight.releases(turn.markers)
            await store.record_interactions(rows, create=created, publish=published, release=release)
            plan.handed += len(created)
            if release:
                inflight.released([member for _, member in release])
        except store_errors.StoreError as exc:
            raise from_store_error(exc) from exc
        # Committed: from here on nothing may turn the answer into an error (a retry would record a
        # duplicate sibling); a turn missing from the implicit-episode index starts a root.
        if index and not published:  # without Redis: the index is this process's map
            try:
                await self.svc.implicit.add(index)
            except GatewayError as exc:
                log.warning("implicit-episode index not updated after commit (%s); a follow-up of these "
                            "turns will start a new episode", exc.message)
        metrics.record_seconds.observe(time.perf_counter() - started)
        metrics.interactions.labels("root" if plan.parent is None else "child").inc(len(rows))
        if plan.root_reason is not None:
            metrics.roots.labels(plan.root_reason).inc(len(rows))
        metrics.tokens.labels("prompt").inc(len(plan.prompt) * len(rows))
        metrics.tokens.labels("output").inc(sum(len(r.output_ids) for r in rows))
        for run in runs:
            metrics.engine_seconds.observe(run.engine_s)

    # ------------------------------------------------------------------------------------ the core's entry points
    def _chat_chain(self, plan: TurnPlan) -> Callable[[ChoiceRun], str]:
        def chain(run: ChoiceRun) -> str:
            assert run.result is not None
            return extend_chain(plan.request_hash, [run.result.message()])
        return chain

    async def _prepare(self, turn: Turn, req: ChatCompletionRequest | CompletionRequest,
                       session: SessionRecord | KeyedSession | None, id_prefix: str | None, meta: dict[str, Any] | None,
                       wire_names: Mapping[str, str] | None = None
                       ) -> tuple[TurnPlan, SamplingParams, list[ChoiceRun], Callable[[ChoiceRun], str]]:
        """Track, plan and size a turn: its plan, sampling parameters, choices and chain-hash function."""
        refuse_unenforced(req, wire_names)
        grammar = grammar_of(req, wire_names)
        if grammar is not None:  # compiled once here, so a bad schema / regex is a 400 naming its field
            grammar = await asyncio.to_thread(check_grammar, grammar)
        if isinstance(req, ChatCompletionRequest):  # tracks a named session itself (with its parent lookup)
            plan = await self.plan_chat(req, session, turn)
            top, parse_tools, chain = (req.top_logprobs or 0) if req.logprobs else 0, req.wants_tools, \
                self._chat_chain(plan)
        else:
            session = await self._resolve(session)
            await self._track(turn, session)
            plan = await self.plan_completion(req, session)
            top, parse_tools, chain = req.logprobs or 0, False, self._completion_chain(plan)
        plan.request.update(meta or {})
        await self._planned(turn, plan)
        await self._track_planned(turn, session, plan)
        params = self._sampling(req, len(plan.prompt), top)
        if grammar is not None:  # sent to the engine and recorded: the turn was sampled under this mask
            params.grammar = grammar.sampling()
            plan.request["params"]["grammar"] = grammar.record()
        prefix = id_prefix or ("chatcmpl" if isinstance(req, ChatCompletionRequest) else "cmpl")
        return plan, params, self._choices(req, prefix, parse_tools), chain

    async def run_turn(self, req: ChatCompletionRequest | CompletionRequest, session: SessionRecord | KeyedSession | None, *,
                       id_prefix: str | None = None, meta: dict[str, Any] | None = None,
                       wire_names: Mapping[str, str] | None = None) -> tuple[TurnPlan, list[ChoiceRun]]:
        """The conversation core, whatever wire format the request came in: plan, generate every choice,
        record; returns the plan and the finished choices for the format to render (``gateway.formats``).
        ``meta`` is recorded with the request (``format`` and what the format kept out of the prompt);
        ``wire_names`` name the core's fields as the format's client sent them, in the params of 400s."""
        async with Turn() as turn:
            plan, params, runs, chain = await self._prepare(turn, req, session, id_prefix, meta, wire_names)
            await self._generate_all(plan, params, runs)
            await self._record(plan, runs, chain, turn)
        return plan, runs

    async def stream_turn(self, req: ChatCompletionRequest | CompletionRequest, session: SessionRecord | KeyedSession | None, *,
                          id_prefix: str | None = None, meta: dict[str, Any] | None = None,
                          wire_names: Mapping[str, str] | None = None
                          ) -> tuple[TurnPlan, list[ChoiceRun], AsyncIterator[TurnEvent]]:
        """The streaming conversation core: plan and start generating (errors before the first engine
        output raise, a normal HTTP error); returns the turn's events (:meth:`_events`) for the format to
        render. The turn is in flight until that iterator ends or is closed."""
        turn = Turn()
        try:
            plan, params, runs, chain = await self._prepare(turn, req, session, id_prefix, meta, wire_names)
            events = await self._start_streams(plan, params, runs, turn, chain)
        except BaseException:
            await turn.aclose()
            raise
        return plan, runs, events

    async def _stream_choice(self, plan: TurnPlan, params: SamplingParams, run: ChoiceRun,
                             queue: asyncio.Queue[tuple[str, Any]]) -> None:
        started = time.perf_counter()
        try:
            gen: Generation | None = None
            stream = self.svc.router.generate(plan.prompt, _with_seed(params, run.seed),
                                              affinity_key=self._affinity(plan), stream=True)
            try:
                async for gen in stream:
                    if gen.finish is not None:
                        break
                    delta = run.decoder.step(gen)
                    if delta:
                        await queue.put(("delta", TurnEvent("delta", run, delta, gen)))
                    if run.decoder.stopped:
                        break
            finally:
                await _aclose(stream)
            if gen is None:
                raise InvalidRequest("the engine produced no output")
            run.engine_s = time.perf_counter() - started
            last, run.result = run.decoder.end(gen)
            await queue.put(("end", TurnEvent("end", run, last, gen)))
        except GatewayError as exc:
            await queue.put(("error", exc))
        except Exception as exc:  # a bug in one choice ends the stream with an error event, never hangs it
            log.exception("streamed choice %d failed", run.index, exc_info=exc)
            await queue.put(("error", GatewayError("internal error in a streamed choice; see the gateway's log")))

    async def _start_streams(self, plan: TurnPlan, params: SamplingParams, runs: list[ChoiceRun],
                             turn: Turn, chain: Callable[[ChoiceRun], str]) -> AsyncIterator[TurnEvent]:
        """Start one generation task per choice and wait for the first event, so that an error before any
        output becomes an HTTP error instead of the start of a stream. Returns the turn's events."""
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._stream_choice(plan, params, run, queue)) for run in runs]
        try:
            await self._while_generating(plan)
            first = await queue.get()
        except BaseException:  # cancelled (the client left before the first token) or a check failed
            await _cancel(tasks)
            raise
        if first[0] == "error":
            await _cancel(tasks)
            raise first[1]
        return self._events(plan, runs, tasks, queue, first, turn, chain)

    async def _events(self, plan: TurnPlan, runs: list[ChoiceRun], tasks: Sequence[asyncio.Future[None]],
                      queue: asyncio.Queue[tuple[str, Any]], first: tuple[str, Any], turn: Turn,
                      chain: Callable[[ChoiceRun], str]) -> AsyncIterator[TurnEvent]:
        """The turn's events in order: deltas and ends of all choices, then ``recorded`` once every choice
        is committed. A :class:`GatewayError` (engine, store) is raised from the iterator; the turn leaves
        the in-flight set and its generation tasks are cancelled when the iterator ends or is closed."""
        try:
            pending = len(runs)
            item: tuple[str, Any] | None = first
            while pending:
                kind, payload = item if item is not None else await queue.get()
                item = None
                if kind == "error":
                    raise payload
                if kind == "end":
                    pending -= 1
                yield payload
            await self._record(plan, runs, chain, turn)
            yield TurnEvent("recorded")
        finally:
            await _cancel(tasks)
            await turn.aclose()

    # ------------------------------------------------------------------------------------ completions
    def prompt_ids(self, given: str | list[int], param: str = "prompt") -> list[int]:
        """A text completion's prompt as token ids: 400 if it is empty or an id is outside the vocabulary."""
        if isinstance(given, str):
            prompt = list(self.svc.tokenizer.encode(given, add_special_tokens=False))
        else:
            vocab = len(self.svc.tokenizer)
            bad = [t for t in given if not 0 <= t < vocab]
            if bad:
                raise InvalidRequest(f"prompt token ids out of the vocabulary (0..{vocab - 1}): {bad[:5]}",
                                     param=param)
            prompt = list(given)
        if not prompt:
            raise InvalidRequest("prompt must not be empty", param=param)
        return prompt

    async def plan_completion(self, req: CompletionRequest, session: SessionRecord | None) -> TurnPlan:
        started = time.perf_counter()
        if len(req.prompts) != 1:
            raise InvalidRequest("a batch of prompts is one turn per prompt", param="prompt")
        given = req.prompts[0]
        prompt = self.prompt_ids(given)
        if session is not None and session.status != "active":
            raise Conflict(f"session {session.id} is {session.status}; it takes no more turns",
                           code="session_not_active")
        request_hash = hashlib.sha256(b"completion:" + _dumps(prompt)).hexdigest()
        plan = TurnPlan(session, None, prompt, prompt, 0, "completion",
                        {"prompt": given, "params": self._params_json(req)}, request_hash,
                        implicit=session is None)
        if session is None:
            plan.group_id = "grp-" + request_hash[:32]
            plan.charged = await self.svc.admission.reserve(req.n)
        plan.timings["plan_ms"] = _ms(started)
        return plan

    def _completion_chain(self, plan: TurnPlan) -> Callable[[ChoiceRun], str]:
        def chain(run: ChoiceRun) -> str:
            assert run.result is not None
            digest = hashlib.sha256(plan.request_hash.encode())
            digest.update(_dumps(run.result.output_ids))
            return digest.hexdigest()
        return chain


# Rendering and tokenizing take ~1 s per MB of text: run them off the event loop, one at a time (a fast
# tokenizer releases the GIL, and one thread keeps its Rust state from being borrowed twice).
_TOKENIZE = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentrl-tokenize")
_LONGEST: dict[int, int] = {}
# A conversation of at most this many characters (its messages' and tools' text) is rendered on the event
# loop itself, when the tokenize thread is idle (so the tokenizer is never used from two threads at once):
# for a short conversation the hop to the thread and back costs more than the rendering.
INLINE_RENDER_CHARS = 8_000
_tokenize_jobs = 0  # jobs handed to the tokenize thread and not finished there yet
# A conversation of more characters than this is validated and hashed on a worker thread and counted in
# tokens before its prompt is built (``GenerationService._refuse_too_many_tokens``): each of those holds
# the interpreter lock in C for ~2-4 ms per MB, so past ~1 MB the event loop would stall for it.
OFF_LOOP_CHARS = 1_000_000
TOKEN_COUNT_MARGIN = 1024


_COUNT_SLICE_CHARS = 1 << 18


def _count_tokens(template: Any, tokenizer: Any, messages: Any, tools: Any) -> int | None:
    """Tokens of the conversation's rendering (with the generation prompt), counted by a fast tokenizer's
    Rust side without building Python lists; None for a tokenizer without one. On the tokenize thread.

    Counted a slice of ~256K characters at a time (cut at a space), each slice's encoding freed before the
    next: the encoding is freed with the interpreter lock held, and the one of a whole 7.9 MB prompt (3.2 M
    tokens) took ~100-250 ms to free. Cutting may move a few tokens at each cut; the caller's margin holds
    that. ``encode_batch_fast`` (tokenizers >= 0.20) skips the offsets, which nobody reads here."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    text = template.render_text(messages, tools)
    count = start = 0
    while start < len(text):
        end = len(text)
        if start + _COUNT_SLICE_CHARS < end:
            end = text.rfind(" ", start + 1, start + _COUNT_SLICE_CHARS)
            if end <= start:
                end = start + _COUNT_SLICE_CHARS
        count += len(encode([text[start:end]], add_special_tokens=False)[0])
        start = end
    return count


async def _off_loop(fn: Callable[..., T], *args: Any, chars: int | None = None) -> T:
    global _tokenize_jobs
    if chars is not None and chars <= INLINE_RENDER_CHARS and not _tokenize_jobs:
        return fn(*args)
    loop = asyncio.get_running_loop()
    _tokenize_jobs += 1
    job = _TOKENIZE.submit(fn, *args)
    # counted until the thread is done with it, even if the awaiting turn went away meanwhile
    job.add_done_callback(lambda _: _call_soon(loop, _tokenize_job_done))
    return await asyncio.wrap_future(job)


def _tokenize_job_done() -> None:
    global _tokenize_jobs
    _tokenize_jobs -= 1


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:  # the loop is closed (shutdown): nothing is rendered inline any more
        pass


def _sample_drift(history_messages: int, every_below: int) -> bool:
    """Whether this child turn runs the drift check: always for a history of at most ``every_below``
    messages, else with probability ``every_below / history_messages`` (the check re-renders the whole
    history, so its expected cost per turn stays that of ``every_below`` messages)."""
    if every_below <= 0:
        return False
    return history_messages <= every_below or random.random() * history_messages < every_below


def _longest_token(tokenizer: Any) -> int:
    """Characters of the vocabulary's longest token string (at least 1), computed once per tokenizer."""
    key = id(tokenizer)
    if key not in _LONGEST:
        try:
            vocab = tokenizer.get_vocab()
            _LONGEST[key] = max(1, max((len(t) for t in vocab), default=1))
        except (AttributeError, NotImplementedError, TypeError):
            _LONGEST[key] = 1_000_000  # unknown: never refuse early
    return _LONGEST[key]


def _text_chars(value: Any) -> int:
    """Characters in every string of a JSON value (keys excluded)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_chars(v) for v in value.values())
    if isinstance(value, list):
        return sum(_text_chars(v) for v in value)
    return 0


def _with_seed(params: SamplingParams, seed: int | None) -> SamplingParams:
    if seed == params.seed:
        return params
    return dataclasses.replace(params, seed=seed)


async def _aclose(events: AsyncIterator[Any]) -> None:
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()


async def _cancel(tasks: Sequence[asyncio.Future[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

