"""`agentrl up`: the main job on one machine (embedded engine, SQLite, gateway, runner, trainer)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("up", help="the main job on one machine (embedded engine, SQLite, gateway, runner, trainer)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print("agentrl up: not implemented yet")
    return 0
