"""`agentrl agent math|tools`: run an example agent over a dataset through the gateway.

    agentrl agent math --gateway http://127.0.0.1:8000 --admin-key K --dataset gsm8k:../shared/data/gsm8k \\
        --split test --group-size 4 --concurrency 8 --limit 50 --eval

Prints the summary (also as one JSON line, for scripts) and exits 0; exits 2 on bad settings or a dataset
error, 3 when the gateway stays unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from agentrl.settings import SettingsError, add_arguments, load
from agents.settings import AGENTS, RunnerSettings


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("agent", help="run an example agent over a dataset through the gateway",
                            description="Run an example agent (math: multi-turn with self-correction; tools: "
                                        "calculator tool calling) over a dataset through the gateway.")
    parser.add_argument("which", choices=AGENTS, nargs="?", default=None,
                        help="the agent (overrides --agent / AGENTRL_AGENT_AGENT)")
    add_arguments(parser, RunnerSettings)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agents.datasets import DatasetError
    from agents.runner import GatewayError, GatewayUnavailable, format_summary, run_agents

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        settings = load(RunnerSettings, args, agent=args.which)
    except SettingsError as exc:
        print(f"agentrl agent: {exc}", file=sys.stderr)
        return 2
    try:
        summary = asyncio.run(run_agents(settings))
    except DatasetError as exc:
        print(f"agentrl agent: {exc}", file=sys.stderr)
        return 2
    except GatewayUnavailable as exc:
        print(f"agentrl agent: gateway unavailable: {exc}", file=sys.stderr)
        return 3
    except GatewayError as exc:
        print(f"agentrl agent: the gateway refused: {exc}", file=sys.stderr)
        return 3
    print(format_summary(summary))
    print(json.dumps(summary))
    return 0
