"""`agentrl bench`: run the benchmarks in bench/."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="run the benchmarks in bench/")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print("agentrl bench: not implemented yet")
    return 0
