"""`agentrl agent math|tools`: run an example agent over a dataset through the gateway.

    agentrl agent math --gateway http://127.0.0.1:8000 --admin-key K --dataset gsm8k:../shared/data/gsm8k \\
        --split test --group-size 4 --concurrency 8 --limit 50 --eval

Prints the summary (also as one JSON line, for scripts) and exits 0; exits 2 on bad settings or a dataset
error, 3 when the gateway stays unreachable, 130 when stopped by Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
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
    async def main() -> dict:
        # SIGTERM (how `agentrl up` and process managers stop us) cancels the run like Ctrl-C, so the reward
        # pool's workers and the HTTP clients are closed on the way out.
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await run_agents(settings)

    try:
        summary = asyncio.run(main())
    except (asyncio.CancelledError, KeyboardInterrupt):
        print("agentrl agent: stopped before the end; no summary", file=sys.stderr)
        return 130
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
