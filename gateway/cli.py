"""`agentrl gateway`: the OpenAI-compatible recording gateway.

    agentrl gateway --engine-url http://127.0.0.1:30000 --db sqlite+aiosqlite:///runs/gw.db \
        --port 8000 --admin-key ADMIN --agent-key AGENT [--redis redis://127.0.0.1:6379/0]

    # several worker processes on one port (PostgreSQL + Redis; see gateway.workers)
    agentrl gateway ... --db postgresql+asyncpg://USER@HOST/DB --redis redis://HOST:6379/0 --workers 4
"""

from __future__ import annotations

import argparse
import sys

from agentrl.command import add_command, run_server
from gateway.settings import GatewaySettings

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUIET = ("httpx", "alembic")  # one line per engine request / migration step otherwise


def register(sub: argparse._SubParsersAction) -> None:
    add_command(sub, "gateway", GatewaySettings, run, help="the OpenAI-compatible recording gateway",
                description="Serve the OpenAI API over SGLang-native engines and record every turn.")


def run(args: argparse.Namespace) -> int:
    return run_server("gateway", GatewaySettings, args, _main, log_format=LOG_FORMAT, quiet=QUIET)


def _main(settings: GatewaySettings) -> int:
    from gateway.workers import Supervisor, check_port_free, serve

    if settings.workers == 1:
        serve(settings)
        return 0
    try:
        check_port_free(settings.host, settings.port)
    except OSError as exc:
        print(f"agentrl gateway: cannot listen on {settings.host}:{settings.port}: {exc}", file=sys.stderr)
        return 1
    return Supervisor(settings).run()
