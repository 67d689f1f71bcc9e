"""An engine whose weight-update side is SGLang's own code, for the broadcast contract test.

``python -m tests.sglang.weight_receiver --port P --tp N`` serves SGLang's four weight-group routes over
HTTP. As in SGLang, the HTTP process validates each body with SGLang's request class (via pydantic, as its
FastAPI routes do) and hands it to N TP worker processes; each worker has a default process group of the
N workers (SGLang's TP group) and runs SGLang's ``WeightUpdater`` methods (``init_weights_update_group``:
``init_custom_process_group`` with ``rank = rank_offset + tp_rank``; ``update_weights_from_distributed`` with
``load_format`` ``flattened_bucket`` or not). The "model" records what ``load_weights`` received;
``GET /loaded`` returns, per TP rank, each name's dtype, shape and sum, so the test compares them with the
trainer's tensors.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import threading
import types
from typing import Any


def _worker(tp_rank: int, tp_size: int, tp_port: int, conn: Any) -> None:
    import torch
    import torch.distributed as dist

    from tests.sglang import own_code

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{tp_port}", rank=tp_rank, world_size=tp_size)
    methods = own_code.weight_updater_methods()

    class Model:
        def __init__(self) -> None:
            self.loaded: dict[str, tuple[str, list[int], float]] = {}

        def load_weights(self, weights: Any) -> None:
            for name, tensor in weights:
                self.loaded[name] = (str(tensor.dtype).removeprefix("torch."), list(tensor.shape),
                                     float(tensor.double().sum()))

    class Runner:  # the attributes WeightUpdater's methods read
        def __init__(self) -> None:
            self.tp_rank, self.device, self._model_update_group, self.model = tp_rank, "cpu", {}, Model()

        def get_model(self) -> Model:
            return self.model

        def _assert_weight_cache_inactive(self, op: str) -> None:
            pass

    runner = Runner()
    runner._update_bucketed_weights_from_distributed = types.MethodType(  # type: ignore[attr-defined]
        methods["_update_bucketed_weights_from_distributed"], runner)
    while True:
        command, args = conn.recv()
        if command == "loaded":
            conn.send(runner.model.loaded)
        elif command == "stop":
            return
        else:
            conn.send(methods[command](runner, **args))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--tp-port", type=int, required=True)
    args = parser.parse_args()

    import pydantic
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from tests.sglang import own_code

    io = own_code.io_struct()
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in range(args.tp):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(rank, args.tp, args.tp_port, child), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    lock = threading.Lock()

    def fan_out(command: str, kwargs: dict[str, Any]) -> list[Any]:
        with lock:
            for pipe in pipes:
                pipe.send((command, kwargs))
            return [pipe.recv() for pipe in pipes]

    def route(cls: Any, command: str, fields: tuple[str, ...]) -> Any:
        async def handler(request: Request) -> JSONResponse:
            body = await request.json()
            try:
                obj = pydantic.TypeAdapter(cls).validate_python(body)
            except pydantic.ValidationError as exc:
                return JSONResponse({"detail": str(exc)}, status_code=422)
            unknown = sorted(set(body) - {f.name for f in __import__("msgspec").structs.fields(cls)})
            if unknown:  # SGLang ignores them; a test must not send fields SGLang would drop
                return JSONResponse({"success": False, "message": f"fields SGLang ignores: {unknown}"}, status_code=400)
            import asyncio

            results = await asyncio.to_thread(fan_out, command, {f: getattr(obj, f) for f in fields})
            ok = all(r[0] for r in results)
            return JSONResponse({"success": ok, "message": "; ".join(r[1] for r in results)},
                                status_code=200 if ok else 400)
        return handler

    async def server_info(request: Request) -> JSONResponse:
        return JSONResponse({"tp_size": args.tp, "version": "0.5.19"})

    async def loaded(request: Request) -> JSONResponse:
        import asyncio

        return JSONResponse(await asyncio.to_thread(fan_out, "loaded", {}))

    app = Starlette(routes=[
        Route("/init_weights_update_group", route(io.InitWeightsUpdateGroupReqInput, "init_weights_update_group",
              ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend")), methods=["POST"]),
        Route("/update_weights_from_distributed", route(io.UpdateWeightsFromDistributedReqInput,
              "update_weights_from_distributed", ("names", "dtypes", "shapes", "group_name", "load_format")),
              methods=["POST"]),
        Route("/destroy_weights_update_group", route(io.DestroyWeightsUpdateGroupReqInput,
              "destroy_weights_update_group", ("group_name",)), methods=["POST"]),
        Route("/get_server_info", server_info),
        Route("/loaded", loaded),
    ])
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    sys.exit(main())
