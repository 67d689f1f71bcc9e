"""`agentrl engine`: the embedded SGLang-compatible inference server."""

from __future__ import annotations

import argparse
import sys

from agentrl.command import add_command, run_server
from engine.config import EngineSettings

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def register(sub: argparse._SubParsersAction) -> None:
    add_command(sub, "engine", EngineSettings, run, help="the embedded SGLang-compatible inference server",
                description="Serve a Hugging Face causal LM over SGLang's native HTTP API with continuous\n"
                            "batching.")


def run(args: argparse.Namespace) -> int:
    return run_server("engine", EngineSettings, args, _main, log_format=LOG_FORMAT)


def _main(settings: EngineSettings) -> int:
    import uvicorn

    from engine.server import create_app
    from engine.service import Engine

    try:
        engine = Engine(settings)
    except (FileNotFoundError, OSError, ValueError) as exc:
        print(f"agentrl engine: cannot load model {settings.model!r}: {exc}", file=sys.stderr)
        return 2
    print(
        f"agentrl engine: {settings.model} ({engine.model_path}) on {settings.device}, "
        f"context {engine.context_length}, listening on http://{settings.host}:{settings.port}",
        flush=True,
    )
    # On SIGTERM, give in-flight requests a few seconds, then stop (they would otherwise hold shutdown).
    uvicorn.run(create_app(engine), host=settings.host, port=settings.port, log_level=settings.log_level,
                timeout_graceful_shutdown=5)
    return 0
