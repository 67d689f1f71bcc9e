"""The engine service: the model, its scheduler, and the operations behind each HTTP route.

Routes (engine/server.py) parse the wire body, call one method here and turn the result into JSON. Errors:

    InvalidRequest (engine.sampling)   -> 400 {"error": {"message": ...}}      bad /generate input
    WeightUpdateError (engine.weights) -> 400 {"success": false, "message": ...}  refused weight update
    MemoryStateError (engine.memory)   -> 400 {"error": {"message": ...}}      refused release/resume
    EngineAsleep                       -> 503 {"error": {"message": ...}}      generation while memory is released
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.weight_group import (FLATTENED_BUCKET, WeightGroup, broadcast_flat, broadcast_tensors, destroy_weight_group,
                                  flat_size, init_weight_group, unflatten)
from engine.config import EngineSettings
from engine.grammar import Grammars
from engine.lora import build_adapter, read_adapter_dir
from engine.memory import WEIGHTS, device_memory, parse_tags
from engine.models import resolve_model
from engine.sampling import InvalidRequest, SamplingParams
from engine.scheduler import Request, Scheduler, Snapshot
from engine.weights import (WeightUpdateError, check_names_and_shapes, decode_named_tensors, load_from_disk,
                            parse_manifest)

log = logging.getLogger("agentrl.engine")

ENGINE_VERSION = "agentrl-embedded-0.1"


@dataclass
class GenerateInput:
    """A validated /generate request."""

    input_ids: list[int]
    params: SamplingParams
    rid: str
    stream: bool
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    return_text_in_logprobs: bool
    grammar: Any = None  # the compiled grammar of params.grammar (engine/grammar.py)
    lora: str | None = None  # the LoRA adapter to serve it with (SGLang's lora_path: a loaded adapter's name)


class EngineAsleep(RuntimeError):
    """Generation asked for while memory is released (``/release_memory_occupation``): answered 503."""


def _deliver(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, snap: Snapshot) -> None:
    """Hand a snapshot from the scheduler thread to the request's event loop."""
    try:
        loop.call_soon_threadsafe(queue.put_nowait, snap)
    except RuntimeError:  # the loop is closed (server shutting down); nobody is waiting any more
        pass


def parse_weight_version(value: Any) -> int | None:
    """SGLang sends the version as a string; the embedded engine keeps integers."""
    if value is None:
        return None
    try:
        return int(str(value))
    except ValueError as exc:
        raise WeightUpdateError(f"weight_version {value!r}: the embedded engine uses integer versions, e.g. \"3\"") from exc


def version_spans(token_versions: list[int], current: int) -> list[dict[str, Any]]:
    """Runs of equal versions as SGLang 0.5.19's ``weight_versions`` (``utils/weight_versions.py``:
    ``compute_weight_version_spans``, ``add_weight_versions_to_meta_info``): ``[{"version": str, "start":
    int, "end": int}, ...]``; no tokens: one empty span of ``current``."""
    if not token_versions:
        return [{"version": str(current), "start": 0, "end": 0}]
    spans: list[dict[str, Any]] = []
    for pos, version in enumerate(token_versions):
        if spans and spans[-1]["version"] == str(version):
            spans[-1]["end"] = pos + 1
        else:
            spans.append({"version": str(version), "start": pos, "end": pos + 1})
    return spans


class Engine:
    def __init__(self, settings: EngineSettings):
        self.settings = settings
        torch.set_num_threads(settings.threads)
        path = resolve_model(settings.model)
        self.model_path = str(path)  # like SGLang, the directory weights were last loaded from
        self.tokenizer_path = str(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        device = torch.device(settings.device)
        # sdpa masks left padding correctly here; tests check logprob parity with a plain forward pass.
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        self.model = model.to(device).eval()
        self.vocab_size = int(self.model.config.vocab_size)
        self.context_length = int(settings.context_length or self.model.config.max_position_embeddings)
        self.scheduler = Scheduler(
            self.model, self.tokenizer, max_running_requests=settings.max_running_requests,
            context_length=self.context_length,
        )
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.scheduler.eos_ids)
        self.scheduler.adapters.default = settings.default_lora or None
        for item in settings.lora_paths:  # before the scheduler thread starts: added directly
            name, _, lora_path = item.partition("=")
            try:
                adapter = build_adapter(self.model, name, lora_path, *read_adapter_dir(lora_path))
            except WeightUpdateError as exc:
                raise WeightUpdateError(f"--lora-paths {item}: {exc}") from exc
            self.scheduler.adapters.add(adapter)
        self.groups: dict[str, WeightGroup] = {}
        self._update_lock = asyncio.Lock()  # one weight update at a time

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()
        for group in self.groups.values():
            destroy_weight_group(group)

    @property
    def weight_version(self) -> str:
        return str(self.scheduler.version)

    # ----- generation -----

    def parse_generate(self, body) -> GenerateInput:
        if (body.input_ids is None) == (body.text is None):
            raise InvalidRequest("give exactly one of input_ids (token ids) or text")
        if body.text is not None:
            input_ids = self.tokenizer.encode(body.text)
        else:
            input_ids = body.input_ids
            if input_ids and isinstance(input_ids[0], list):
                raise InvalidRequest("batched input_ids are not supported by the embedded engine; send one request per prompt")
        if not input_ids:
            raise InvalidRequest("the prompt is empty: input_ids must hold at least one token id")
        bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"input_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        params = SamplingParams.parse(body.sampling_params, vocab_size=self.vocab_size)
        if len(input_ids) >= self.context_length:
            raise InvalidRequest(
                f"The input ({len(input_ids)} tokens) is longer than the model's context length ({self.context_length} tokens)."
            )
        explicit = (body.sampling_params or {}).get("max_new_tokens") is not None
        if not explicit:  # like SGLang, the default is clipped to the room left in the context
            params.max_new_tokens = min(params.max_new_tokens, self.context_length - len(input_ids))
        if len(input_ids) + params.max_new_tokens > self.context_length:
            raise InvalidRequest(
                f"Requested token count exceeds the model's maximum context length of {self.context_length} tokens: "
                f"{len(input_ids)} prompt tokens + max_new_tokens {params.max_new_tokens}. Reduce max_new_tokens "
                f"to at most {self.context_length - len(input_ids)}."
            )
        top = body.top_logprobs_num or 0
        if not 0 <= top <= 100:
            raise InvalidRequest(f"top_logprobs_num must be in [0, 100], got {top}")
        start = -1 if body.logprob_start_len is None else body.logprob_start_len
        if start < -1 or start >= len(input_ids):
            raise InvalidRequest(f"logprob_start_len must be -1 or a prompt position in [0, {len(input_ids)}), got {start}")
        return GenerateInput(
            lora=self._lora_name(getattr(body, "lora_path", None)),
            input_ids=list(input_ids),
            params=params,
            rid=body.rid or uuid.uuid4().hex,
            stream=bool(body.stream),
            return_logprob=bool(body.return_logprob),
            logprob_start_len=start,
            top_logprobs_num=top if body.return_logprob else 0,
            return_text_in_logprobs=bool(body.return_text_in_logprobs),
        )

    def _lora_name(self, lora_path: Any) -> str | None:
        """SGLang's ``lora_path``: the name of a loaded adapter (a list: one per prompt of a batch)."""
        if isinstance(lora_path, list):
            if len(lora_path) != 1:
                raise InvalidRequest("lora_path as a list names one adapter per prompt; the embedded engine takes "
                                     "one prompt per request, so send a string (or a list of one)")
            lora_path = lora_path[0]
        if not lora_path:  # the base model, or --default-lora's adapter (AdapterSet.rows resolves it per step)
            return None
        loaded = self.scheduler.adapters.paths()
        if lora_path not in loaded:  # SGLang 0.5.19 TokenizerManager._resolve_lora_path's refusal
            raise InvalidRequest(f"Got LoRA adapter that has never been loaded: {lora_path}. "
                                 f"All loaded adapters: {sorted(loaded)}.")
        return lora_path

    def check_awake(self) -> None:
        released = self.scheduler.memory.released
        if released:
            raise EngineAsleep(f"the engine's memory is released ({sorted(released)}) while a trainer uses the GPU; "
                               "generation resumes after POST /resume_memory_occupation")

    async def generate(self, inp: GenerateInput, is_disconnected=None) -> AsyncIterator[dict[str, Any]]:
        """Yield response dicts: one at the end, or (stream) one per new token, each cumulative."""
        if inp.params.grammar is not None and inp.grammar is None:
            # compiled off the event loop (the first grammar also scans the vocabulary: seconds); a grammar
            # that does not compile raises InvalidRequest here: a 400, or an error event in a stream
            inp.grammar = await asyncio.to_thread(self.grammars.compile, *inp.params.grammar)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Snapshot] = asyncio.Queue()
        req = Request(
            rid=inp.rid,
            input_ids=inp.input_ids,
            params=inp.params,
            on_update=lambda snap: _deliver(loop, queue, snap),
            stream=inp.stream,
            return_logprob=inp.return_logprob,
            top_logprobs_num=inp.top_logprobs_num,
            input_logprobs=inp.return_logprob and inp.logprob_start_len >= 0,
            grammar=self._matcher(inp),
            lora=inp.lora,
        )
        self.scheduler.submit(req)
        finished = False
        try:
            while not finished:
                try:
                    # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation that
                    # lands as the item arrives, and the stream would keep its batch slot
                    async with asyncio.timeout(1.0):
                        snap = await queue.get()
                except TimeoutError:
                    if is_disconnected is not None and await is_disconnected():
                        return
                    continue
                while not queue.empty():  # cumulative snapshots: only the newest matters
                    snap = queue.get_nowait()
                finished = snap.finish_reason is not None
                yield self.to_json(inp, snap)
        finally:
            if not finished:  # client went away: free the batch slot
                self.scheduler.control("abort", request=req, message="client disconnected")

    def _matcher(self, inp: GenerateInput) -> Any:
        """The request's grammar matcher: the grammar may end on the row's stop tokens (its
        ``stop_token_ids``, and EOS unless ``ignore_eos``)."""
        if inp.grammar is None:
            return None
        stops = set(inp.params.stop_token_ids) | (set() if inp.params.ignore_eos else self.scheduler.eos_ids)
        return self.grammars.matcher(inp.grammar, stops or self.scheduler.eos_ids)

    def to_json(self, inp: GenerateInput, snap: Snapshot) -> dict[str, Any]:
        reason = snap.finish_reason
        params = inp.params
        ids = snap.output_ids
        matched = reason.get("matched") if reason else None
        if isinstance(matched, int) and not params.no_stop_trim and ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        if isinstance(matched, str):
            pos = text.find(matched)
            if pos != -1:
                text = text[: pos + len(matched)] if params.no_stop_trim else text[:pos]
        meta: dict[str, Any] = {
            "id": inp.rid,
            "finish_reason": reason,
            "prompt_tokens": len(inp.input_ids),
            "completion_tokens": len(snap.output_ids),
            "cached_tokens": 0,
            "weight_version": str(snap.weight_version),
            "num_retractions": snap.retractions,
        }
        if reason is not None:  # SGLang 0.5.19: the finished output names the version of each run of tokens
            meta["weight_versions"] = version_spans(snap.token_versions, snap.weight_version)
        if inp.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, tok, self._token_text(tok, inp)] for lp, tok in zip(snap.logprobs, snap.output_ids)
            ]
            meta["output_token_logprobs_length"] = len(snap.output_ids)
            prompt = snap.input_logprobs[inp.logprob_start_len :] if inp.logprob_start_len >= 0 else []
            meta["input_token_logprobs"] = [
                [lp, tok, self._token_text(tok, inp)]
                for lp, tok in zip(prompt, inp.input_ids[inp.logprob_start_len :] if prompt else [])
            ]
            if inp.top_logprobs_num > 0:
                meta["output_top_logprobs"] = [
                    [[lp, tok, self._token_text(tok, inp)] for lp, tok in row] for row in snap.top_logprobs
                ]
        if snap.e2e_latency is not None:
            meta["e2e_latency"] = snap.e2e_latency
        return {"text": text, "output_ids": snap.output_ids, "meta_info": meta}

    def _token_text(self, token: int, inp: GenerateInput) -> str | None:
        return self.tokenizer.decode([token]) if inp.return_text_in_logprobs else None

    # ----- control -----

    async def health(self) -> bool:
        """SGLang's ``/health``: submit a one-token generation and answer healthy as soon as the scheduler
        produces any token after the probe began (so a busy engine answers at once). Like any request it
        waits behind a pause, so a paused engine is unhealthy after ``health_timeout_s`` (SGLang:
        ``SGLANG_HEALTH_CHECK_TIMEOUT``, 20 s, polled every second; polled every 0.1 s here)."""
        if not self.scheduler.alive or self.scheduler.memory.asleep:
            return False
        started = time.monotonic()
        probe = Request(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[0],
                        params=SamplingParams.parse({"max_new_tokens": 1, "temperature": 0.0},
                                                    vocab_size=self.vocab_size),
                        on_update=lambda snap: None)
        self.scheduler.submit(probe)
        try:
            while time.monotonic() < started + self.settings.health_timeout_s:
                await asyncio.sleep(0.1)
                if self.scheduler.last_output > started:
                    return True
                if not self.scheduler.alive:
                    return False
            return False
        finally:
            if probe.finish_reason is None:
                self.scheduler.control("abort", request=probe, message="health check over")

    async def pause(self, mode: str) -> None:
        await asyncio.wrap_future(self.scheduler.control("pause", mode=mode))

    async def resume(self) -> None:
        await asyncio.wrap_future(self.scheduler.control("continue"))

    async def abort(self, rid: str | None, abort_all: bool) -> None:
        await asyncio.wrap_future(self.scheduler.control("abort", rid=rid, abort_all=abort_all))

    # ----- memory (engine.memory) -----

    async def release_memory(self, tags: list[str] | None) -> list[str]:
        """SGLang's ``/release_memory_occupation``; returns the tags now released."""
        wanted = parse_tags(tags)
        async with self._update_lock:  # not in the middle of a weight update
            started = time.perf_counter()
            released = await asyncio.wrap_future(self.scheduler.control("release_memory", tags=wanted))
            log.warning("released %s in %.3fs (%s)", wanted, time.perf_counter() - started,
                        device_memory(self.scheduler.memory.device) or "cpu")
            return released

    async def resume_memory(self, tags: list[str] | None) -> list[str]:
        """SGLang's ``/resume_memory_occupation``; returns the tags still released."""
        if tags:
            parse_tags(tags)
        async with self._update_lock:
            started = time.perf_counter()
            still = await asyncio.wrap_future(self.scheduler.control("resume_memory", tags=tags or None))
            log.warning("resumed %s in %.3fs (%s)", tags or "all", time.perf_counter() - started,
                        device_memory(self.scheduler.memory.device) or "cpu")
            return still

    def check_weights_resident(self) -> None:
        if WEIGHTS in self.scheduler.memory.released:
            raise WeightUpdateError("the weights are released (release_memory_occupation); resume them first: "
                                    "POST /resume_memory_occupation {\"tags\": [\"weights\"]}")

    # ----- weights -----

    async def update_from_disk(self, model_path: str, *, weight_version: Any, abort_all: bool) -> int:
        version = parse_weight_version(weight_version)
        async with self._update_lock:
            self.check_weights_resident()
            started = time.perf_counter()
            tensors = await asyncio.to_thread(load_from_disk, self.model, model_path)
            new = await asyncio.wrap_future(self.scheduler.swap_weights(tensors, version=version, abort_running=abort_all))
            log.warning("weights from %s -> version %s in %.2fs", model_path, new, time.perf_counter() - started)
            self.model_path = model_path
            return new

    async def update_version(self, weight_version: Any, *, abort_all: bool) -> int:
        """SGLang's ``/update_weight_version``: the same weights, a new version for tokens generated from now on
        (requests running at the call finish under the old label unless ``abort_all``)."""
        version = parse_weight_version(weight_version)
        async with self._update_lock:
            return await asyncio.wrap_future(self.scheduler.swap_weights({}, version=version, abort_running=abort_all))

    async def update_from_tensor(self, serialized_named_tensors: list[str], *, load_format: str | None,
                                 weight_version: Any, abort_all: bool) -> int:
        """SGLang's ``/update_weights_from_tensor``: tensors by handle (CUDA IPC on a shared GPU), copied in place."""
        version = parse_weight_version(weight_version)
        async with self._update_lock:
            self.check_weights_resident()
            started = time.perf_counter()
            tensors = await asyncio.to_thread(decode_named_tensors, self.model, serialized_named_tensors, load_format)
            new = await asyncio.wrap_future(self.scheduler.swap_weights(tensors, version=version, abort_running=abort_all))
            if any(t.is_cuda for t in tensors.values()):
                torch.cuda.synchronize()  # the sender may reuse its memory as soon as we answer
            del tensors
            log.warning("weights from tensor handles -> version %s in %.3fs", new, time.perf_counter() - started)
            return new

    async def init_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                         group_name: str, backend: str) -> None:
        if group_name in self.groups:
            raise WeightUpdateError(f"weight update group {group_name!r} exists; destroy it first")
        if backend == "nccl" and self.settings.device != "cuda":
            raise WeightUpdateError("backend 'nccl' needs the engine on --device cuda; use backend 'gloo' on CPU")
        try:
            group = await asyncio.to_thread(
                init_weight_group, master_address=master_address, master_port=master_port, rank=rank_offset,
                world_size=world_size, backend=backend, group_name=group_name,
            )
        except (ValueError, RuntimeError, OSError) as exc:  # bad arguments, rendezvous timeout, port errors
            raise WeightUpdateError(f"could not join weight update group {group_name!r}: {exc}") from exc
        self.groups[group_name] = group

    def destroy_group(self, group_name: str) -> None:
        group = self.groups.pop(group_name, None)
        if group is None:
            raise WeightUpdateError(f"no weight update group {group_name!r}")
        destroy_weight_group(group)

    async def update_from_distributed(self, *, names, dtypes, shapes, group_name: str, weight_version: Any,
                                      abort_all: bool, load_format: str | None = None) -> int:
        """Receive one bucket over the group: with ``load_format="flattened_bucket"`` as ONE ``uint8``
        broadcast cut back by names/dtypes/shapes, otherwise one broadcast per tensor (SGLang's
        ``WeightUpdater.update_weights_from_distributed``)."""
        group = self.groups.get(group_name)
        if group is None:
            raise WeightUpdateError(f"no weight update group {group_name!r}: call /init_weights_update_group first")
        manifest = parse_manifest(names, dtypes, shapes)
        version = parse_weight_version(weight_version)
        async with self._update_lock:
            refusal: WeightUpdateError | None = None
            try:
                self.check_weights_resident()
                check_names_and_shapes(self.model, {n: s for n, _, s in manifest}, complete=False)
            except WeightUpdateError as exc:
                refusal = exc  # still receive the bucket below, so that the sender's broadcast completes
            try:
                if load_format == FLATTENED_BUCKET:
                    layout = [(dtype, shape) for _, dtype, shape in manifest]
                    flat = torch.empty(flat_size(layout), dtype=torch.uint8, device=group.device)
                    await asyncio.to_thread(broadcast_flat, group, flat, 0)
                    buffers = unflatten(flat, layout)
                else:
                    buffers = [torch.empty(shape, dtype=dtype, device=group.device) for _, dtype, shape in manifest]
                    await asyncio.to_thread(broadcast_tensors, group, buffers, 0)
            except RuntimeError as exc:
                raise WeightUpdateError(f"broadcast on group {group_name!r} failed: {exc}") from exc
            if refusal is not None:
                raise refusal
            tensors = {name: buf for (name, _, _), buf in zip(manifest, buffers)}
            return await asyncio.wrap_future(
                self.scheduler.swap_weights(tensors, version=version, abort_running=abort_all)
            )

    # ----- info -----

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "served_model_name": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
        }

    def server_info(self) -> dict[str, Any]:
        memory = self.scheduler.memory
        state = {**self.scheduler.stats.as_dict(), **self.scheduler.counts(), "paused": self.scheduler.paused,
                 "memory_released": sorted(memory.released), "decoding_held": self.scheduler.held(),
                 "num_pending_weight_updates": self.scheduler.pending_swaps(),
                 **device_memory(memory.device)}
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "device": self.settings.device,
            "context_length": self.context_length,
            "max_running_requests": self.settings.max_running_requests,
            "max_req_input_len": self.context_length - 1,
            "tp_size": 1,  # one rank in a weight-update group (SGLang: rank_offset + tp_rank)
            "weight_version": self.weight_version,
            "version": ENGINE_VERSION,
            "internal_states": [state],
        }
