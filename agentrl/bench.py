"""`agentrl bench`: run the benchmarks in bench/ (each prints its own table, with ratios to a baseline)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"


# modules of bench/ that are not benchmarks themselves (chaos_check checks a chaos run's history file)
HELPERS = {"chaos_check"}


def available() -> list[str]:
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if not p.name.startswith("_") and p.stem not in HELPERS)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="run the benchmarks in bench/",
                            description="Run benchmarks from bench/ in one go; extra arguments go to each script.")
    parser.add_argument("names", nargs="*", help=f"which benchmarks (default: all of {', '.join(available()) or 'none'})")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    names = args.names or available()
    unknown = sorted(set(names) - set(available()))
    if unknown:
        print(f"agentrl bench: unknown benchmark(s) {unknown}; available: {available()}", file=sys.stderr)
        return 2
    status = 0
    for name in names:
        print(f"== bench/{name}.py", flush=True)
        status |= subprocess.call([sys.executable, str(BENCH_DIR / f"{name}.py")])
    return status
