"""The `agentrl` command: one entry point, one subcommand per component.

Each component owns its subcommand in its own `cli.py` (``register(subparsers)`` adds the parser and sets
``func``), so this file only wires them together. Imports are lazy where they are heavy.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module whose register() defines it
SUBCOMMANDS = {
    "up": "agentrl.up",
    "serve": "agentrl.serve",
    "eval": "agentrl.evaluate",
    "engine": "engine.cli",
    "gateway": "gateway.cli",
    "train": "trainer.cli",
    "export-model": "trainer.export",
    "agent": "agents.cli",
    "bench": "agentrl.bench",
    "group": "agentrl.group",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentrl",
        description="Train OpenAI-SDK agents with RL through a token-exact recording gateway.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
