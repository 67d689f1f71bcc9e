"""HTTP routes of the embedded engine: SGLang's native API (docs/sglang-protocol.md), thin over ``Engine``.

Error shapes follow SGLang: a body that fails schema validation gets 400
``{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}``; a request the engine
refuses gets 400 ``{"error": {"message": ...}}``, or, when it asked for a stream, status 200 with the event
``data: {"error": {"message", "type", "code", "retryable"}}`` then ``data: [DONE]``; weight updates answer ``{"success": false, "message"}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, ValidationError

from engine import lora_routes
from engine.memory import MemoryStateError
from engine.sampling import InvalidRequest
from engine.scheduler import PAUSE_MODES
from engine.service import Engine, EngineAsleep
from engine.weights import WeightUpdateError

log = logging.getLogger("agentrl.engine")


class Wire(BaseModel):
    """Request bodies accept (and log) fields this engine does not use, as SGLang's dataclasses ignore them."""

    model_config = ConfigDict(extra="allow")

    def log_unknown(self, route: str) -> None:
        if self.model_extra:
            log.info("%s: ignoring fields %s", route, sorted(self.model_extra))


class GenerateIn(Wire):
    text: StrictStr | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: dict[str, Any] | None = None
    return_logprob: StrictBool | None = None
    logprob_start_len: StrictInt | None = None
    top_logprobs_num: StrictInt | None = None
    return_text_in_logprobs: StrictBool = False
    stream: StrictBool = False
    rid: StrictStr | None = None
    lora_path: StrictStr | list[StrictStr | None] | None = None  # a loaded LoRA adapter's name (engine/lora.py)


class PauseIn(Wire):
    mode: StrictStr = "abort"


class AbortIn(Wire):
    rid: StrictStr | None = None
    abort_all: StrictBool = False


class UpdateFromDiskIn(Wire):
    model_path: StrictStr
    load_format: StrictStr | None = None
    abort_all_requests: StrictBool = False
    weight_version: StrictStr | StrictInt | None = None


class UpdateVersionIn(Wire):
    """SGLang 0.5.19 ``UpdateWeightVersionReqInput``."""

    new_version: StrictStr | StrictInt
    abort_all_requests: StrictBool = True


class UpdateFromTensorIn(Wire):
    """SGLang 0.5.19 ``UpdateWeightsFromTensorReqInput`` as HTTP JSON (bytes as base64 strings)."""

    serialized_named_tensors: list[StrictStr]
    load_format: StrictStr | None = None
    flush_cache: StrictBool = True
    abort_all_requests: StrictBool = False
    weight_version: StrictStr | StrictInt | None = None
    disable_draft_model: StrictBool | None = None
    torch_empty_cache: StrictBool = False


class MemoryOccupationIn(Wire):
    """SGLang 0.5.19 ``ReleaseMemoryOccupationReqInput`` / ``ResumeMemoryOccupationReqInput``."""

    tags: list[StrictStr] | None = None


class InitGroupIn(Wire):
    master_address: StrictStr
    master_port: StrictInt
    rank_offset: StrictInt
    world_size: StrictInt
    group_name: StrictStr = "weight_update_group"
    backend: StrictStr = "nccl"


class HoldIn(Wire):
    """Test hook (``--test-hooks``): hold decoding once a running request has this many output tokens."""

    at_output_tokens: StrictInt


class DestroyGroupIn(Wire):
    group_name: StrictStr = "weight_update_group"


class UpdateFromDistributedIn(Wire):
    names: list[StrictStr]
    dtypes: list[StrictStr]
    shapes: list[list[StrictInt]]
    group_name: StrictStr = "weight_update_group"
    flush_cache: StrictBool = True
    abort_all_requests: StrictBool = False
    weight_version: StrictStr | StrictInt | None = None
    load_format: StrictStr | None = None


def _bad_request(message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=400)


def _error_event(message: str) -> bytes:
    # SGLang 0.5.19 (http_server.generate_request): message, type, code, retryable
    error = {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


async def _error_events(message: str) -> AsyncIterator[bytes]:
    yield _error_event(message)
    yield b"data: [DONE]\n\n"


def _weight_result(ok: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": ok, "message": message, **extra}, status_code=200 if ok else 400)


async def _optional_body(request: Request, model: type[Wire]) -> Wire:
    """Bodies SGLang makes optional (pause, continue): empty means defaults."""
    raw = await request.body()
    try:
        data = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as exc:
        raise RequestValidationError([{"loc": ["body"], "msg": f"invalid JSON: {exc}", "type": "json_invalid"}]) from exc
    if not isinstance(data, dict):
        raise RequestValidationError([{"loc": ["body"], "msg": "body must be a JSON object", "type": "type_error"}])
    try:
        return model.model_validate(data)
    except ValidationError as exc:  # the same 400 as a schema error of a required body
        raise RequestValidationError([{**e, "loc": ["body", *e["loc"]]} for e in exc.errors()]) from exc


def create_app(engine: Engine) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="agentrl embedded engine (SGLang native API)", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message = "; ".join(
            f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg')}" for err in exc.errors()
        ) or str(exc)
        body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
        return JSONResponse(body, status_code=400)

    @app.exception_handler(InvalidRequest)
    async def invalid_request(request: Request, exc: InvalidRequest) -> JSONResponse:
        return _bad_request(str(exc))

    @app.exception_handler(MemoryStateError)
    async def memory_state_error(request: Request, exc: MemoryStateError) -> JSONResponse:
        return _bad_request(str(exc))

    @app.exception_handler(EngineAsleep)
    async def engine_asleep(request: Request, exc: EngineAsleep) -> JSONResponse:
        return JSONResponse({"error": {"message": str(exc)}}, status_code=503)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(body: GenerateIn, request: Request) -> Response:
        body.log_unknown("/generate")
        engine.check_awake()  # released memory: 503 before anything streams
        if body.stream:
            # SGLang checks a request past its schema only once the stream has begun: such an error is
            # an event (status 200), then [DONE]. Only schema errors answer 400 before streaming.
            try:
                inp = engine.parse_generate(body)
            except InvalidRequest as exc:
                return StreamingResponse(_error_events(str(exc)), media_type="text/event-stream")

            async def events():
                try:
                    async for out in engine.generate(inp):
                        yield b"data: " + json.dumps(out).encode() + b"\n\n"
                except InvalidRequest as exc:
                    yield _error_event(str(exc))
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        inp = engine.parse_generate(body)
        result = None
        async for out in engine.generate(inp, is_disconnected=request.is_disconnected):
            result = out
        if result is None:  # client disconnected; nobody reads this
            return Response(status_code=499)
        return JSONResponse(result)

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return Response(status_code=200 if await engine.health() else 503)

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return engine.model_info()

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": engine.weight_version}

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return engine.server_info()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": engine.settings.model, "object": "model", "owned_by": "agentrl", "root": engine.model_path,
                "max_model_len": engine.context_length}
        # SGLang 0.5.19 lists each loaded adapter after the base model, its parent
        adapters = [{"id": name, "object": "model", "owned_by": "agentrl", "root": path, "parent": card["id"],
                     "max_model_len": None} for name, path in engine.scheduler.adapters.paths().items()]
        return {"object": "list", "data": [card, *adapters]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        state = engine.server_info()["internal_states"][0]
        lines = []
        for key, value in state.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                lines.append(f"agentrl_engine_{key} {value}")
        lines.append(f"agentrl_engine_weight_version {engine.weight_version}")
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        return PlainTextResponse("Cache flushed.\n")  # no prefix cache to flush

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        body = await _optional_body(request, PauseIn)
        if body.mode not in PAUSE_MODES:
            return _bad_request(f"Invalid mode: {body.mode!r}. Expected one of {list(PAUSE_MODES)}.")
        await engine.pause(body.mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> JSONResponse:
        await _optional_body(request, Wire)
        await engine.resume()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    if engine.settings.test_hooks:
        @app.post("/test/hold_decoding")
        async def hold_decoding(body: HoldIn) -> JSONResponse:
            if body.at_output_tokens < 1:
                return _bad_request("at_output_tokens must be at least 1")
            await asyncio.wrap_future(engine.scheduler.control("hold", at_output_tokens=body.at_output_tokens))
            return JSONResponse({"status": "ok"})

        @app.post("/test/release_decoding")
        async def release_decoding() -> JSONResponse:
            await asyncio.wrap_future(engine.scheduler.control("release"))
            return JSONResponse({"status": "ok"})

    @app.post("/abort_request")
    async def abort_request(body: AbortIn) -> Response:
        if body.rid is None and not body.abort_all:
            return _bad_request("give rid, or abort_all: true")
        await engine.abort(body.rid, body.abort_all)
        return Response(status_code=200)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateFromDiskIn) -> JSONResponse:
        body.log_unknown("/update_weights_from_disk")
        try:
            version = await engine.update_from_disk(
                body.model_path, weight_version=body.weight_version, abort_all=body.abort_all_requests
            )
        except WeightUpdateError as exc:
            return _weight_result(False, f"Failed to update weights: {exc}. The old weights keep serving.",
                                  num_paused_requests=0)
        return _weight_result(True, f"Succeeded to update model weights. Weight version updated to {version}.",
                              num_paused_requests=0)

    @app.post("/update_weight_version")
    async def update_weight_version(body: UpdateVersionIn) -> JSONResponse:
        body.log_unknown("/update_weight_version")
        try:
            version = await engine.update_version(body.new_version, abort_all=body.abort_all_requests)
        except WeightUpdateError as exc:
            return _weight_result(False, f"Failed to update the weight version: {exc}")
        return _weight_result(True, f"Weight version updated to {version}", new_version=str(version))

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(body: UpdateFromTensorIn) -> JSONResponse:
        body.log_unknown("/update_weights_from_tensor")
        try:
            await engine.update_from_tensor(body.serialized_named_tensors, load_format=body.load_format,
                                            weight_version=body.weight_version, abort_all=body.abort_all_requests)
        except WeightUpdateError as exc:
            return _weight_result(False, f"Failed to update weights: {exc}. The old weights keep serving.")
        return _weight_result(True, "Success")

    # SGLang answers both with status 200 and the body null (the route returns None), or 400
    # {"error": {"message"}}; it accepts GET too. The body may be empty (all tags).
    def memory_route(path: str, act: Callable[[list[str] | None], Awaitable[Any]]) -> None:
        @app.api_route(path, methods=["GET", "POST"], name=path.strip("/"))
        async def route(request: Request) -> JSONResponse:
            body = await _optional_body(request, MemoryOccupationIn)
            body.log_unknown(path)
            await act(body.tags)
            return JSONResponse(None)

    memory_route("/release_memory_occupation", engine.release_memory)
    memory_route("/resume_memory_occupation", engine.resume_memory)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitGroupIn) -> JSONResponse:
        try:
            await engine.init_group(
                master_address=body.master_address, master_port=body.master_port, rank_offset=body.rank_offset,
                world_size=body.world_size, group_name=body.group_name, backend=body.backend,
            )
        except WeightUpdateError as exc:
            return _weight_result(False, str(exc))
        return _weight_result(True, "Succeeded to initialize custom process group.")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: DestroyGroupIn) -> JSONResponse:
        try:
            engine.destroy_group(body.group_name)
        except WeightUpdateError as exc:
            return _weight_result(False, str(exc))
        return _weight_result(True, "Succeeded to destroy custom process group.")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: UpdateFromDistributedIn) -> JSONResponse:
        body.log_unknown("/update_weights_from_distributed")
        try:
            version = await engine.update_from_distributed(
                names=body.names, dtypes=body.dtypes, shapes=body.shapes, group_name=body.group_name,
                weight_version=body.weight_version, abort_all=body.abort_all_requests, load_format=body.load_format,
            )
        except WeightUpdateError as exc:
            return _weight_result(False, f"Failed to update weights: {exc}. The old weights keep serving.")
        return _weight_result(True, f"Succeeded to update parameter online. Weight version updated to {version}.")

    lora_routes.add_routes(app, engine)  # /load_lora_adapter, /load_lora_adapter_from_tensors, /unload_lora_adapter
    return app
