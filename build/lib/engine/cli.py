"""`agentrl engine`: the embedded SGLang-compatible inference server."""

from __future__ import annotations

import argparse
import logging
import sys

from agentrl.settings import SettingsError, add_arguments, load
from engine.config import EngineSettings


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "engine",
        help="the embedded SGLang-compatible inference server",
        description="Serve a Hugging Face causal LM over SGLang's native HTTP API with continuous batching.",
    )
    add_arguments(parser, EngineSettings)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        settings = load(EngineSettings, args)
    except SettingsError as exc:
        print(f"agentrl engine: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")

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
