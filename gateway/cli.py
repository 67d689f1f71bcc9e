"""`agentrl gateway`: the OpenAI-compatible recording gateway."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("gateway", help="the OpenAI-compatible recording gateway")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print("agentrl gateway: not implemented yet")
    return 0
