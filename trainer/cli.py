"""`agentrl train`: the GRPO trainer (also: torchrun -m trainer)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("train", help="the GRPO trainer (also: torchrun -m trainer)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print("agentrl train: not implemented yet")
    return 0
