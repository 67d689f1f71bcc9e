"""The scheduler thread: continuous batching, pause/abort, and weight swaps between steps.

One thread owns the model. Each loop iteration it (1) runs control commands (pause, continue, abort,
weight swaps), (2) admits waiting requests with one batched prefill and merges them into the running
batch, (3) runs one batched decode step for all running requests and (4) drops finished rows. HTTP
handlers never touch the model: they ``submit`` requests and ``control`` commands, and receive
``Snapshot``s through a callback that the server turns into JSON.

Pauses (SGLang's ``pause_generation`` modes, 0.5.19 ``Scheduler.pause_generation``): ``abort`` aborts every
request; ``retract`` moves the running requests back to the front of the waiting queue with their output so
far and drops their KV cache: after ``continue`` they are prefilled again over prompt + output (under the
weights current then) and go on to finish normally; ``in_place`` leaves the running batch, KV cache
included, as it is. Requests that arrive while paused wait.

Weight versions: every sampled token records the version of the weights that sampled it. A weight swap
waits until no request is running (new requests wait meanwhile), unless generation is paused (then it is
applied at once: the requests a ``retract``/``in_place`` pause holds continue under the new weights) or
``abort_all_requests`` aborts the running ones. So a request's tokens span several versions only across a
``retract``/``in_place`` pause; its finished output reports the spans (SGLang 0.5.19's ``weight_versions``).

Test hooks (``--test-hooks`` only): ``hold(at_output_tokens=N)`` stops decoding once a running request has N
output tokens, until ``release``. Tests that need an event in the middle of a generation (a weight push
landing mid-story, a disconnect while the engine is busy) hold the story at a known token count and act
then, instead of sleeping and hoping the story is still running: on a fast machine a story of hundreds of
tokens ended within the sleep (CI, 2026-12-04). While held, controls, weight swaps and admission go on (a
new request gets its first token at prefill, so ``/health`` stays healthy); only the decode step waits.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from engine import batch as batching
from engine.grammar import advance, mask_rows
from engine.lora import AdapterSet
from engine.memory import WEIGHTS, MemoryOccupation
from engine.sampling import SamplingParams, sample
from engine.weights import WeightUpdateError

log = logging.getLogger("agentrl.engine")

PAUSE_MODES = ("abort", "retract", "in_place")
HEALTH_CHECK_PREFIX = "HEALTH_CHECK"  # rid prefix of /health's probe requests (SGLang's HEALTH_CHECK_RID_PREFIX)


@dataclass
class Snapshot:
    """What a client sees of a request at one moment (copies; safe to read from another thread)."""

    output_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[float, int]]]
    input_logprobs: list[float | None]
    finish_reason: dict[str, Any] | None
    weight_version: int
    e2e_latency: float | None
    token_versions: list[int] = field(default_factory=list)  # the weight version of each output token
    retractions: int = 0


@dataclass(eq=False)  # identity, not field equality: two requests may carry the same fields
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    on_update: Callable[[Snapshot], None]
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    input_logprobs: bool = False
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    weight_version: int = 0  # the version it was admitted under (then: of its last token)
    token_versions: list[int] = field(default_factory=list)
    retractions: int = 0  # times a ``retract`` pause took it out of the batch (SGLang's num_retractions)
    created: float = field(default_factory=time.perf_counter)
    generator: torch.Generator | None = None
    grammar: Any = None  # the request's xgrammar GrammarMatcher (engine/grammar.py), if it is constrained
    lora: str | None = None  # the adapter it is served with (engine/lora.py; SGLang's lora_path), None: the base

    def snapshot(self) -> Snapshot:
        finished = self.finish_reason is not None
        return Snapshot(
            list(self.output_ids),
            list(self.logprobs),
            [list(t) for t in self.top_logprobs],
            list(self.prompt_logprobs),
            self.finish_reason,
            self.token_versions[-1] if self.token_versions else self.weight_version,
            time.perf_counter() - self.created if finished else None,
            list(self.token_versions),
            self.retractions,
        )


@dataclass
class Stats:
    """Batching statistics, exposed in /get_server_info and /metrics."""

    decode_steps: int = 0
    decode_rows: int = 0  # sum over decode steps of the batch size
    max_batch_size: int = 0
    prefill_batches: int = 0
    prefill_requests: int = 0
    generated_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    retracted_requests: int = 0
    weight_updates: int = 0

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["mean_decode_batch_size"] = self.decode_rows / self.decode_steps if self.decode_steps else 0.0
        return out


class Scheduler:
    def __init__(self, model, tokenizer, *, max_running_requests: int, context_length: int, version: int = 0):
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_running = max_running_requests
        self.context_length = context_length
        self.version = version
        self.stats = Stats()
        self.eos_ids = _eos_ids(model, tokenizer)
        self.pad_id = min(self.eos_ids) if self.eos_ids else 0  # any valid id: padded columns are masked
        self.paused: str | None = None  # pause mode while paused
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._batch: batching.Batch | None = None
        self._controls: collections.deque[tuple[str, dict, Future]] = collections.deque()
        self._swaps: list[tuple[dict[str, torch.Tensor], int | None, bool, Future]] = []
        self._wake = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self.memory = MemoryOccupation(model)  # release/resume_memory_occupation (engine.memory)
        self.adapters = AdapterSet(model)  # LoRA adapters applied per request (engine.lora)
        self.error: BaseException | None = None
        self.last_output = 0.0  # time.monotonic() of the last sampled token (what /health waits for)
        self.hold_at: int | None = None  # test hook: no decode step once a running request has this many tokens

    # ----- called from other threads -----

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, req: Request) -> None:
        with self._wake:
            self._waiting.append(req)
            self._wake.notify()

    def control(self, command: str, **args: Any) -> Future:
        """Run ``command`` between scheduler steps; the future holds its result.

        ``pause(mode)``, ``continue()``, ``abort(rid=... | request=... | abort_all=True, message=...)``,
        ``release_memory(tags=[...])``, ``resume_memory(tags=[...] | None)`` (engine.memory).
        """
        future: Future = Future()
        with self._wake:
            self._controls.append((command, args, future))
            self._wake.notify()
        return future

    def swap_weights(self, tensors: dict[str, torch.Tensor], *, version: int | None, abort_running: bool) -> Future:
        """Copy ``tensors`` (already validated) into the model once no request is running."""
        future: Future = Future()
        with self._wake:
            self._swaps.append((tensors, version, abort_running, future))
            self._wake.notify()
        return future

    def swap_adapters(self, change: Callable[[AdapterSet], Any]) -> Future:
        """Run ``change(self.adapters)`` (load or unload a LoRA adapter) when a weight swap would run: between
        steps, once no request is running or at once while paused, so an adapter never changes under a running
        request's tokens; the version is not changed (SGLang's adapter routes carry none)."""
        future: Future = Future()
        with self._wake:
            self._swaps.append((change, None, False, future))
            self._wake.notify()
        return future

    def counts(self) -> dict[str, int]:
        with self._wake:
            return {"num_running_reqs": len(self._running), "num_waiting_reqs": len(self._waiting)}

    def pending_swaps(self) -> int:
        """Weight updates waiting for the running requests to finish (``/get_server_info``)."""
        with self._wake:
            return len(self._swaps)

    def held(self) -> bool:
        """True while the test hook holds decoding (a running request has reached ``hold_at`` tokens)."""
        hold_at = self.hold_at
        return hold_at is not None and any(len(r.output_ids) >= hold_at for r in list(self._running))

    # ----- the scheduler thread -----

    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._stop and not self._has_work():
                        self._wake.wait(timeout=1.0)
                    if self._stop:
                        break
                    controls = list(self._controls)
                    self._controls.clear()
                for command, args, future in controls:
                    self._run_control(command, args, future)
                if self._swaps:
                    self._apply_swaps()
                if self.paused is None and not self._swaps:
                    self._admit()
                if self.paused is None and self._running and not self.held():
                    self._decode()
        except BaseException as exc:  # a bug or OOM in the model: fail every request loudly, report unhealthy
            log.exception("scheduler thread died")
            self.error = exc
            for req in list(self._running) + list(self._waiting):
                self._finish(req, {"type": "abort", "message": f"engine error: {exc}"})
            raise

    def _has_work(self) -> bool:
        if self._controls:
            return True
        if self._swaps and (self.paused is not None or not self._running or any(a for _, _, a, _ in self._swaps)):
            return True  # a swap that can be applied now (otherwise it waits for the running requests)
        if self.paused is not None:
            return False
        if self.held():  # only admission goes on (a pending swap holds that too)
            return bool(self._waiting) and not self._swaps
        return bool(self._running or self._waiting)

    def _run_control(self, command: str, args: dict, future: Future) -> None:
        try:
            if command == "pause":
                mode = args.get("mode", "abort")
                if mode not in PAUSE_MODES:
                    raise ValueError(f"unknown pause mode {mode!r}; valid: {', '.join(PAUSE_MODES)}")
                self.paused = mode
                if mode == "abort":
                    self._abort_all("paused (abort mode)")
                elif mode == "retract":
                    self._retract_all()
                future.set_result(None)
            elif command == "continue":
                self.paused = None
                future.set_result(None)
            elif command == "abort":
                rid, target, abort_all = args.get("rid"), args.get("request"), args.get("abort_all", False)
                message = args.get("message", "aborted by /abort_request")
                if abort_all:
                    self._abort_all(message)
                else:
                    for req in [r for r in list(self._waiting) + self._running if r is target or r.rid == rid]:
                        if req.finish_reason is None:
                            self._abort(req, message)
                future.set_result(None)
            elif command == "hold":  # test hook (see the module docstring)
                at = int(args["at_output_tokens"])
                if at < 1:
                    raise ValueError("at_output_tokens must be at least 1")
                self.hold_at = at
                future.set_result(None)
            elif command == "release":
                self.hold_at = None
                future.set_result(None)
            elif command == "release_memory":
                with self._wake:  # health probes wait behind a pause; they must not keep the engine busy
                    probes = [r for r in self._waiting if r.rid.startswith(HEALTH_CHECK_PREFIX)]
                for req in probes:
                    self._abort(req, "memory released")
                with self._wake:
                    idle = not self._running and not self._waiting
                if idle:
                    self._batch = None
                future.set_result(self.memory.release(args["tags"], idle=idle))
            elif command == "resume_memory":
                future.set_result(self.memory.resume(args.get("tags")))
            else:
                raise ValueError(f"unknown control command {command!r}")
        except BaseException as exc:
            future.set_exception(exc)

    def _apply_swaps(self) -> None:
        if self._running and any(abort for _, _, abort, _ in self._swaps):
            self._abort_all("aborted for a weight update")
        if self._running and self.paused is None:
            return  # drain: running requests finish under the old weights; admission is held meanwhile
        # idle, or paused: an in_place pause keeps its batch (KV of the old weights) and goes on with the new
        state = self.model.state_dict(keep_vars=True)
        for tensors, version, _, future in self._swaps:
            try:
                if callable(tensors):  # an adapter change (swap_adapters)
                    future.set_result(tensors(self.adapters))
                    continue
                if tensors and WEIGHTS in self.memory.released:
                    raise WeightUpdateError("the weights are released (release_memory_occupation); resume them "
                                            "first: POST /resume_memory_occupation {\"tags\": [\"weights\"]}")
                with torch.no_grad():
                    for name, tensor in tensors.items():
                        state[name].copy_(tensor.to(device=state[name].device, dtype=state[name].dtype))
                self.version = version if version is not None else self.version + 1
                self.stats.weight_updates += 1
                future.set_result(self.version)
            except BaseException as exc:
                future.set_exception(exc)
        self._swaps.clear()

    def _retract_all(self) -> None:
        """SGLang's ``retract`` pause: running requests leave the batch, their KV cache dropped, and go back
        to the front of the waiting queue with their output so far (re-prefilled on admission)."""
        retracted = list(self._running)
        self._running, self._batch = [], None
        for req in retracted:
            req.retractions += 1
        self.stats.retracted_requests += len(retracted)
        with self._wake:
            self._waiting.extendleft(reversed(retracted))

    def _abort_all(self, message: str) -> None:
        with self._wake:
            waiting = list(self._waiting)
            self._waiting.clear()
        for req in waiting:
            self._finish(req, {"type": "abort", "message": message})
        for req in list(self._running):
            self._abort(req, message)

    def _abort(self, req: Request, message: str) -> None:
        with self._wake:
            if req in self._waiting:
                self._waiting.remove(req)
        if req in self._running:
            row = self._running.index(req)
            self._drop_rows([row])
        self.stats.aborted_requests += 1
        self._finish(req, {"type": "abort", "message": message})

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        req.finish_reason = reason
        self.stats.finished_requests += 1
        req.on_update(req.snapshot())

    def _drop_rows(self, rows: list[int]) -> None:
        keep = [i for i in range(len(self._running)) if i not in set(rows)]
        self._batch = batching.keep(self._batch, keep) if self._batch is not None else None
        self._running = [self._running[i] for i in keep]

    def _admit(self) -> None:
        if self.memory.asleep:  # a request that slipped in while the memory was being released
            with self._wake:
                late = list(self._waiting)
            for req in late:
                self._abort(req, f"engine memory released ({sorted(self.memory.released)}): "
                                 "call /resume_memory_occupation first")
            return
        with self._wake:
            room = self.max_running - len(self._running)
            new = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
        if not new:
            return
        for req in new:
            if not req.output_ids:  # a retracted request keeps its version and its sampler's state
                req.weight_version = self.version
                req.generator = req.params.generator(self.device)
        ready = []
        for req in new:
            if req.params.max_new_tokens == 0:
                self._finish(req, {"type": "length", "length": 0})
            elif req.lora and req.lora not in self.adapters.loaded:  # unloaded while it waited (a pause)
                self._abort(req, f"LoRA adapter {req.lora!r} was unloaded")
            else:
                ready.append(req)
        if not ready:
            return
        # prompt logprobs once, at the first admission (a retracted request is prefilled again over prompt +
        # output: every token's KV recomputed, and the last position's logits give its next token)
        first = [not r.output_ids and r.input_logprobs for r in ready]
        with self.adapters.rows([r.lora for r in ready]):
            new_batch, logits = batching.prefill(
                self.model, [r.input_ids + r.output_ids for r in ready], self.pad_id, all_logits=any(first)
            )
        if any(first):
            for row, req in enumerate(ready):
                if first[row]:
                    req.prompt_logprobs = _prompt_logprobs(logits[row], req.input_ids)
            logits = logits[:, -1, :]
        self.stats.prefill_batches += 1
        self.stats.prefill_requests += len(ready)
        finished = self._sample_and_advance(ready, new_batch, logits)
        keep = [i for i in range(len(ready)) if i not in finished]
        new_batch = batching.keep(new_batch, keep)
        if new_batch is not None:
            self._batch = batching.merge(self._batch, new_batch)
            self._running.extend(ready[i] for i in keep)
            self.stats.max_batch_size = max(self.stats.max_batch_size, len(self._running))

    def _decode(self) -> None:
        gone = [row for row, r in enumerate(self._running) if r.lora and r.lora not in self.adapters.loaded]
        for req in [self._running[row] for row in gone]:  # its adapter was unloaded during an in_place pause
            self._abort(req, f"LoRA adapter {req.lora!r} was unloaded")
        if not self._running:
            return
        with self.adapters.rows([r.lora for r in self._running]):
            logits = batching.decode(self.model, self._batch)
        self.stats.decode_steps += 1
        self.stats.decode_rows += len(self._running)
        finished = self._sample_and_advance(self._running, self._batch, logits)
        if finished:
            self._drop_rows(sorted(finished))

    def _sample_and_advance(self, reqs: list[Request], batch: batching.Batch, logits: torch.Tensor) -> set[int]:
        """Sample a token for every row, record it, and return the rows that finished."""
        constrained = [row for row, r in enumerate(reqs) if r.grammar is not None]
        if constrained:  # only these rows are masked; a batch without grammars skips this entirely
            logits = mask_rows(logits, constrained, [reqs[row].grammar for row in constrained])
        tokens, logprobs, dist = sample(logits, [r.params for r in reqs], [r.generator for r in reqs],
                                        [r.output_ids for r in reqs], self.eos_ids)
        self.last_output = time.monotonic()
        batch.pending = tokens.to(self.device)
        finished = set()
        for row, req in enumerate(reqs):
            token = int(tokens[row])
            req.output_ids.append(token)
            req.logprobs.append(float(logprobs[row]))
            req.token_versions.append(self.version)
            if req.top_logprobs_num > 0:
                values, ids = dist[row].topk(req.top_logprobs_num)
                # tokens outside the sampled support (masked, filtered) have no probability: not listed
                req.top_logprobs.append([(float(v), int(i)) for v, i in zip(values.cpu(), ids.cpu())
                                         if v > float("-inf")])
            self.stats.generated_tokens += 1
            if req.grammar is not None and not advance(req.grammar, token):
                finished.add(row)
                self._finish(req, {"type": "abort", "message": f"grammar refused sampled token {token}"})
                continue
            reason = self._stop_reason(req, token)
            if reason is not None:
                finished.add(row)
                self._finish(req, reason)
            elif req.stream:
                req.on_update(req.snapshot())
        return finished

    def _stop_reason(self, req: Request, token: int) -> dict[str, Any] | None:
        params = req.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_ids):
            return {"type": "stop", "matched": token}
        if params.stop:
            tail = self.tokenizer.decode(req.output_ids[-64:], skip_special_tokens=False)
            for stop in params.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        if len(req.output_ids) >= params.max_new_tokens:
            return {"type": "length", "length": len(req.output_ids)}
        if len(req.input_ids) + len(req.output_ids) >= self.context_length:
            return {"type": "length", "length": len(req.output_ids)}
        return None


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def _prompt_logprobs(logits: torch.Tensor, prompt: list[int]) -> list[float | None]:
    """Log-probabilities (temperature 1) of each prompt token given the ones before; None for the first.

    ``logits``: (P, V) of the left-padded row; the prompt occupies the last ``len(prompt)`` positions.
    """
    n = len(prompt)
    rows = torch.log_softmax(logits[-n:-1].float(), dim=-1)
    targets = torch.tensor(prompt[1:], device=rows.device)
    values = rows.gather(-1, targets[:, None]).squeeze(-1).tolist() if n > 1 else []
    return [None, *values]
