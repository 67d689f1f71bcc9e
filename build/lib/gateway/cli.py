"""`agentrl gateway`: the OpenAI-compatible recording gateway.

    agentrl gateway --engine-url http://127.0.0.1:30000 --db sqlite+aiosqlite:///runs/gw.db \
        --port 8000 --admin-key ADMIN --agent-key AGENT [--redis redis://127.0.0.1:6379/0]

    # several worker processes on one port (PostgreSQL + Redis; see gateway.workers)
    agentrl gateway ... --db postgresql+asyncpg://USER@HOST/DB --redis redis://HOST:6379/0 --workers 4
"""

from __future__ import annotations

import argparse
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
    from gateway.workers import Supervisor, check_port_free, configure_logging, serve

    configure_logging(settings)
    if settings.workers == 1:
        serve(settings)
        return 0
    try:
        check_port_free(settings.host, settings.port)
    except OSError as exc:
        print(f"agentrl gateway: cannot listen on {settings.host}:{settings.port}: {exc}", file=sys.stderr)
        return 1
    return Supervisor(settings).run()
