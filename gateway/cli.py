"""`agentrl gateway`: the OpenAI-compatible recording gateway.

    agentrl gateway --engine-url http://127.0.0.1:30000 --db sqlite+aiosqlite:///runs/gw.db \
        --port 8000 --admin-key ADMIN --agent-key AGENT [--redis redis://127.0.0.1:6379/0]
"""

from __future__ import annotations

import argparse
import logging
import sys

from agentrl.settings import SettingsError, add_arguments, load
from gateway.settings import GatewaySettings


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("gateway", help="the OpenAI-compatible recording gateway",
                            description="Serve the OpenAI API over SGLang-native engines and record every turn.")
    add_arguments(parser, GatewaySettings)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        settings = load(GatewaySettings, args)
    except SettingsError as exc:
        print(f"agentrl gateway: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "alembic"):  # one line per engine request / migration step otherwise
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    import uvicorn

    from gateway.app import create_app

    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                access_log=False, timeout_graceful_shutdown=5)
    return 0
