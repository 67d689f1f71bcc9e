"""The embedded engine's LoRA routes, SGLang 0.5.19's (``srt/entrypoints/http_server.py``, bodies from
``srt/managers/io_struct.py``), over :mod:`engine.lora`:

- ``POST /load_lora_adapter {"lora_name", "lora_path", "pinned"}``: a peft adapter directory;
- ``POST /load_lora_adapter_from_tensors {"lora_name", "config_dict", "serialized_named_tensors",
  "load_format"}``: base64 of a ``ForkingPickler`` dump of ``{peft key: tensor}`` (CUDA IPC handles, or
  shared-memory files for CPU tensors), one payload per tensor-parallel rank (the first is used here);
- ``POST /unload_lora_adapter {"lora_name"}``;
- each answers ``LoRAUpdateOutput`` ``{"success", "error_message", "loaded_adapters": {name: path}}``, 200, or
  400 when refused (then nothing changed). Like SGLang, a name that is loaded is refused (a new version is
  unload + load) and an unknown name cannot be unloaded.

Loads and unloads are checked off the event loop and applied by the scheduler between steps like a weight
swap (``Scheduler.swap_adapters``): once no request is running, or at once while generation is paused, so
the pause / push / resume of a full weight update works the same for adapters. They do not move the weight
version; ``/update_weight_version`` does (as on SGLang).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr

from engine.lora import AdapterSet, build_adapter, read_adapter_dir
from engine.weights import WeightUpdateError, unpickle_tensors

log = logging.getLogger("agentrl.engine")


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # SGLang's internal fields (lora_id, ...) are accepted and unused


class LoadIn(_Body):
    lora_name: StrictStr
    lora_path: StrictStr
    pinned: StrictBool = False


class LoadFromTensorsIn(_Body):
    lora_name: StrictStr
    config_dict: dict[str, Any]
    serialized_named_tensors: list[StrictStr]
    pinned: StrictBool = False
    load_format: StrictStr | None = None


class UnloadIn(_Body):
    lora_name: StrictStr


def _result(adapters: AdapterSet, error: str | None = None) -> JSONResponse:
    body = {"success": error is None, "error_message": error or "", "loaded_adapters": adapters.paths()}
    return JSONResponse(body, status_code=200 if error is None else 400)


def _tensor_dict(serialized: list[str], load_format: str | None) -> dict:
    if load_format not in (None, "direct"):
        raise WeightUpdateError(f"load_format {load_format!r} is not supported here; send null (a dict of tensors)")
    payload = unpickle_tensors(serialized)
    if not isinstance(payload, dict) or not all(isinstance(k, str) for k in payload):
        raise WeightUpdateError("the payload must be a dict of {peft key: tensor}, as SGLang's "
                                "load_lora_adapter_from_tensors sends it")
    return payload


def add_routes(app: FastAPI, engine) -> None:
    """Add the LoRA routes for ``engine`` (an :class:`engine.service.Engine`)."""
    scheduler = engine.scheduler
    adapters: AdapterSet = scheduler.adapters

    async def load(name: str, path: str, read) -> JSONResponse:
        async with engine._update_lock:  # one weight or adapter change at a time
            started = time.perf_counter()
            try:
                if name in adapters.loaded:
                    raise WeightUpdateError(f"Failed to load LoRA adapter {name} because it is already loaded")
                config, tensors = await asyncio.to_thread(read)
                adapter = await asyncio.to_thread(build_adapter, engine.model, name, path, config, tensors)
            except WeightUpdateError as exc:
                return _result(adapters, str(exc))

            def add(served: AdapterSet) -> None:
                if name in served.loaded:  # loaded by another route meanwhile (both are under the lock)
                    raise WeightUpdateError(f"Failed to load LoRA adapter {name} because it is already loaded")
                served.add(adapter)

            try:
                await asyncio.wrap_future(scheduler.swap_adapters(add))
            except WeightUpdateError as exc:
                return _result(adapters, str(exc))
            log.warning("LoRA adapter %r (rank %d, %d modules, %.1f MB) from %s in %.3fs", name, adapter.rank,
                        len(adapter.layers), adapter.nbytes / 1e6, path, time.perf_counter() - started)
            return _result(adapters)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadIn) -> JSONResponse:
        return await load(body.lora_name, body.lora_path, lambda: read_adapter_dir(body.lora_path))

    @app.post("/load_lora_adapter_from_tensors")
    async def load_lora_adapter_from_tensors(body: LoadFromTensorsIn) -> JSONResponse:
        return await load(body.lora_name, "__tensor__",
                          lambda: (body.config_dict, _tensor_dict(body.serialized_named_tensors, body.load_format)))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadIn) -> JSONResponse:
        name = body.lora_name

        def remove(served: AdapterSet) -> None:
            if name not in served.loaded:
                # SGLang 0.5.19 LoRARegistry.unregister's refusal
                raise WeightUpdateError(f"LoRA with name {name} does not exist. Loaded LoRAs: {sorted(served.loaded)}")
            served.remove(name)

        async with engine._update_lock:
            try:
                await asyncio.wrap_future(scheduler.swap_adapters(remove))
            except WeightUpdateError as exc:
                return _result(adapters, str(exc))
        return _result(adapters)
