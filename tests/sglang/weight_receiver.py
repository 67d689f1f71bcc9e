"""An engine whose weight-update side is SGLang's own code (0.5.19 or 0.5.23), for the push contract tests.

``python -m tests.sglang.weight_receiver --port P --tp N --tp-port Q --version V`` serves SGLang's weight
routes over HTTP. As in SGLang, the HTTP process validates each body with release V's request class (via
pydantic, as its FastAPI routes do) and hands it to N TP worker processes; each worker has a default process
group of the N workers (SGLang's TP group, gloo) and runs release V's own code:

- 0.5.19: the ``WeightUpdater`` methods (``init_weights_update_group``: ``init_custom_process_group`` with
  ``rank = rank_offset + tp_rank``; ``update_weights_from_distributed``, flattened bucket or not;
  ``update_weights_from_tensor`` after ``BaseTpWorker._deserialize_own_rank``, which opens
  ``serialized_named_tensors[tp_rank]``), then the TP barrier the scheduler runs after a tensor update.
- 0.5.23: the scheduler's ``SchedulerWeightUpdaterManager`` methods (``begin_weight_update``,
  ``end_weight_update``, and the distributed and tensor updates that refuse to run outside a session),
  over 0.5.23's ``WeightUpdater`` methods (``receive_weights_from_distributed``,
  ``load_weights_from_distributed``, ``update_weights_from_tensor``, ``begin/end_weight_update``) and
  ``BaseTpWorker.deserialize_own_rank``. The model loader's session hooks (restore before loading,
  post-process after) are recorded instead of run: they act on quantized CUDA weights.

The "model" records what ``load_weights`` received; ``GET /loaded`` returns, per TP rank, each name's dtype,
shape and sum, and the session hooks each rank ran, so the test compares them with the trainer's tensors.
``GET /server_info`` answers like SGLang's (``version``, ``tp_size``), ``/get_server_info`` too.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import threading
import types
from typing import Any

ROUTES = {  # route -> (request class, 0.5.19 WeightUpdater method and the fields it takes)
    "/init_weights_update_group": ("InitWeightsUpdateGroupReqInput", "init_weights_update_group",
                                   ("master_address", "master_port", "rank_offset", "world_size", "group_name",
                                    "backend")),
    "/update_weights_from_distributed": ("UpdateWeightsFromDistributedReqInput", "update_weights_from_distributed",
                                         ("names", "dtypes", "shapes", "group_name", "load_format")),
    "/destroy_weights_update_group": ("DestroyWeightsUpdateGroupReqInput", "destroy_weights_update_group",
                                      ("group_name",)),
    "/update_weights_from_tensor": ("UpdateWeightsFromTensorReqInput", "update_weights_from_tensor", ()),
    "/begin_weight_update": ("BeginWeightUpdateReqInput", "begin_weight_update", ()),
    "/end_weight_update": ("EndWeightUpdateReqInput", "end_weight_update", ()),
}
SESSION_ROUTES = ("/begin_weight_update", "/end_weight_update")


class Model:
    def __init__(self) -> None:
        self.loaded: dict[str, tuple[str, list[int], float]] = {}
        self.hooks: list[str] = []  # the model loader's session hooks (0.5.23), in order

    def load_weights(self, weights: Any) -> None:
        for name, tensor in weights:
            self.loaded[name] = (str(tensor.dtype).removeprefix("torch."), list(tensor.shape),
                                 float(tensor.double().sum()))


def _bind(target: Any, methods: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        setattr(target, name, types.MethodType(methods[name], target))


def _worker(version: str, tp_rank: int, tp_size: int, tp_port: int, conn: Any) -> None:
    import pydantic
    import torch
    import torch.distributed as dist

    from tests.sglang import own_code

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{tp_port}", rank=tp_rank, world_size=tp_size)
    io = own_code.io_struct(version)
    updater = own_code.weight_updater_methods(version)
    parallel = types.SimpleNamespace(tp_rank=tp_rank, tp_size=tp_size)
    updater["globals"]["get_parallel"] = lambda: parallel
    updater["worker_globals"]["get_parallel"] = lambda: parallel
    model = Model()

    # the attributes SGLang's WeightUpdater methods read (a frozen dataclass in SGLang)
    runner = types.SimpleNamespace(tp_rank=tp_rank, device="cpu", _model_update_group={}, custom_weight_loaders={},
                                   get_model=lambda: model, _assert_weight_cache_inactive=lambda op: None)
    tp_worker = types.SimpleNamespace(ps=parallel)
    tp_worker.deserialize = types.MethodType(updater["deserialize_own_rank"], tp_worker)
    if version == own_code.PINNED:
        _bind(runner, updater, ("_update_bucketed_weights_from_distributed",))
    else:
        loader = types.SimpleNamespace(restore_weights_before_loading=lambda m, device: m.hooks.append("restore"),
                                       postprocess_weights=lambda m, device: m.hooks.append("postprocess"))
        updater["globals"].update(DefaultModelLoader=loader, post_load_weights=lambda m: m.hooks.append("post_load"))
        _bind(runner, updater, ("init_weights_update_group", "destroy_weights_update_group",
                                "receive_weights_from_distributed", "_receive_bucketed_weights_from_distributed",
                                "load_weights_from_distributed", "update_weights_from_tensor",
                                "begin_weight_update", "end_weight_update"))
        scheduler = own_code.scheduler_weight_updater(version)
        scheduler["globals"]["get_parallel"] = lambda: parallel
        model_runner = types.SimpleNamespace(weight_updater=runner)
        tp_worker.model_runner = model_runner
        tp_worker.weight_update_runners = lambda: [("target", model_runner)]
        tp_worker.init_weights_update_group = lambda req: runner.init_weights_update_group(
            req.master_address, req.master_port, req.rank_offset, req.world_size, req.group_name, req.backend)
        tp_worker.destroy_weights_update_group = lambda req: runner.destroy_weights_update_group(req.group_name)
        tp_worker.deserialize_own_rank = tp_worker.deserialize
        manager = types.SimpleNamespace(
            tp_worker=tp_worker, draft_worker=None, metrics_collector=None, _session=None,
            tp_cpu_group=dist.group.WORLD, flush_cache=lambda empty_cache=False: True,
            scheduler=types.SimpleNamespace(record_weight_version_change=lambda new_version: None))
        _bind(manager, scheduler, ("_select_runners", "_observe_weight_load", "flush_cache_after_weight_update",
                                   "record_weight_version_after_update", "begin_weight_update", "end_weight_update",
                                   "update_weights_from_distributed", "update_weights_from_tensor",
                                   "init_weights_update_group", "destroy_weights_update_group"))

    def handle(route: str, body: dict[str, Any]) -> tuple[bool, str]:
        cls_name, method, fields = ROUTES[route]
        req = pydantic.TypeAdapter(getattr(io, cls_name)).validate_python(body)
        if version != own_code.PINNED:  # the scheduler's handler, as SGLang dispatches the request
            out = getattr(manager, method)(req)
            return bool(out.success), str(out.message)
        if route == "/update_weights_from_tensor":  # TpModelWorker + WeightUpdater, then the scheduler's barrier
            named = tp_worker.deserialize(req.serialized_named_tensors)
            result = updater[method](runner, named_tensors=named, load_format=req.load_format)
            torch.distributed.barrier()
            return result
        return updater[method](runner, **{f: getattr(req, f) for f in fields})

    conn.send("ready")
    while True:
        try:
            command, args = conn.recv()
        except EOFError:  # the HTTP process is gone (the test stopped the receiver)
            return
        if command == "loaded":
            conn.send({"weights": model.loaded, "hooks": model.hooks})
        elif command == "stop":
            return
        else:
            try:
                conn.send(handle(command, args))
            except Exception as exc:  # noqa: BLE001 - SGLang answers a failed handler as an error response
                conn.send((False, f"{type(exc).__name__}: {exc}"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--tp-port", type=int, required=True)
    parser.add_argument("--version", default="0.5.19")
    args = parser.parse_args()

    import asyncio

    import msgspec
    import pydantic
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from tests.sglang import own_code

    io = own_code.io_struct(args.version)
    ctx = mp.get_context("spawn")
    pipes = []
    for rank in range(args.tp):
        parent, child = ctx.Pipe()
        ctx.Process(target=_worker, args=(args.version, rank, args.tp, args.tp_port, child), daemon=True).start()
        pipes.append(parent)
    for pipe in pipes:  # a worker that cannot load SGLang's code fails the receiver at start, not a request
        if pipe.recv() != "ready":
            raise SystemExit("a TP worker did not start")
    lock = threading.Lock()

    def fan_out(command: str, payload: Any) -> list[Any]:
        with lock:
            for pipe in pipes:
                pipe.send((command, payload))
            return [pipe.recv() for pipe in pipes]

    def route(path: str) -> Any:
        cls = getattr(io, ROUTES[path][0])

        async def handler(request: Request) -> JSONResponse:
            body = await request.json() if await request.body() else {}
            try:
                pydantic.TypeAdapter(cls).validate_python(body)
            except pydantic.ValidationError as exc:
                return JSONResponse({"detail": str(exc)}, status_code=422)
            unknown = sorted(set(body) - {f.name for f in msgspec.structs.fields(cls)})
            if unknown:  # SGLang ignores them; a test must not send fields SGLang would drop
                return JSONResponse({"success": False, "message": f"fields SGLang ignores: {unknown}"}, status_code=400)
            results = await asyncio.to_thread(fan_out, path, body)
            ok = all(r[0] for r in results)
            return JSONResponse({"success": ok, "message": "; ".join(r[1] for r in results)},
                                status_code=200 if ok else 400)
        return handler

    async def server_info(request: Request) -> JSONResponse:
        return JSONResponse({"tp_size": args.tp, "version": args.version})

    async def loaded(request: Request) -> JSONResponse:
        return JSONResponse(await asyncio.to_thread(fan_out, "loaded", {}))

    paths = [p for p in ROUTES if args.version != own_code.PINNED or p not in SESSION_ROUTES]
    app = Starlette(routes=[*(Route(p, route(p), methods=["POST"]) for p in paths),
                            Route("/server_info", server_info), Route("/get_server_info", server_info),
                            Route("/loaded", loaded)])
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    sys.exit(main())
