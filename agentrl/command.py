"""What every `agentrl` command shares: its parser and its preamble.

The servers (`agentrl engine`, `agentrl gateway`) load their settings and set up logging through
:func:`run_server`; SIGTERM is theirs (uvicorn's graceful shutdown, the gateway's worker supervisor).

`up`, `serve` and `eval` start children (engine, gateway, trainer) inside ``with Processes(...)``, which
stops them all when the block is left. Ctrl-C leaves it through ``KeyboardInterrupt``; SIGTERM (a process
manager, ``kill``, a CI timeout) used to end the supervisor at once, without leaving any block, so the
children lived on until their parent-death signal reached them (the gateway for ~15 s, with a traceback).
:func:`run_command` turns SIGTERM into the same ``KeyboardInterrupt``, so both stop everything the same
way and exit with the same status.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

from agentrl.settings import SettingsError, add_arguments, load

T = TypeVar("T")


def add_command(sub: argparse._SubParsersAction, name: str, settings: type, run: Callable[[argparse.Namespace], int],
                *, help: str, description: str | None) -> argparse.ArgumentParser:
    """The subcommand ``name``: one flag per field of ``settings`` (agentrl.settings), ``func=run``."""
    parser = sub.add_parser(name, help=help, description=description,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, settings)
    parser.set_defaults(func=run)
    return parser


def run_command(name: str, settings: type[T], args: argparse.Namespace, main: Callable[[T], int], *,
                errors: Mapping[type[BaseException], int] | None = None, interrupted: int = 130,
                interrupted_says: str = "interrupted; every process it started has been stopped") -> int:
    """Load the settings (exit 2 with the message when they are wrong), then ``main(settings)``.

    An exception of a type in ``errors`` is printed and exits with its status; Ctrl-C and SIGTERM print
    ``interrupted_says`` and exit with ``interrupted``.
    """
    loaded = load_settings(name, settings, args)
    if loaded is None:
        return 2
    try:
        with sigterm_as_interrupt():
            return main(loaded)
    except KeyboardInterrupt:
        print(f"\nagentrl {name}: {interrupted_says}", file=sys.stderr)
        return interrupted
    except tuple(errors or ()) as exc:
        print(f"agentrl {name}: {exc}", file=sys.stderr)
        return next(code for kind, code in (errors or {}).items() if isinstance(exc, kind))


def load_settings(name: str, settings: type[T], args: argparse.Namespace) -> T | None:
    """The command's settings (flags > env > YAML > defaults, validated), or None once it has printed why
    they are wrong (the command then exits 2)."""
    try:
        return load(settings, args)
    except SettingsError as exc:
        print(f"agentrl {name}: {exc}", file=sys.stderr)
        return None


def run_server(name: str, settings: type[T], args: argparse.Namespace, main: Callable[[T], int], *,
               log_format: str, quiet: tuple[str, ...] = ()) -> int:
    """The preamble of a command that serves until it is stopped: load the settings (exit 2 with the message
    when they are wrong), log at their ``log_level`` in ``log_format`` (the loggers named in ``quiet`` at
    warnings and above: one line per request otherwise), then ``main(settings)``."""
    loaded = load_settings(name, settings, args)
    if loaded is None:
        return 2
    configure_logging(loaded.log_level, log_format, quiet)  # type: ignore[attr-defined]
    return main(loaded)


def configure_logging(level: str, log_format: str, quiet: tuple[str, ...] = ()) -> None:
    logging.basicConfig(level=level.upper(), format=log_format)
    for noisy in quiet:
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside the block, SIGTERM raises ``KeyboardInterrupt`` in the main thread, as Ctrl-C does.

    Only the first one: a second SIGTERM while the children are being stopped is ignored, so it cannot cut
    that stop short (it is bounded: SIGTERM to each child, SIGKILL after a grace period). Elsewhere than in
    the main thread, where Python runs no signal handler, nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = False

    def on_sigterm(signum: int, frame: Any) -> None:
        nonlocal fired
        if not fired:
            fired = True
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
