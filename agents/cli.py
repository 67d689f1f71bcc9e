"""`agentrl agent`: run an example agent over a dataset through the gateway."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("agent", help="run an example agent over a dataset through the gateway")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print("agentrl agent: not implemented yet")
    return 0
