"""`agentrl engine`: the embedded SGLang-compatible inference server."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("engine", help="the embedded SGLang-compatible inference server")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print("agentrl engine: not implemented yet")
    return 0
