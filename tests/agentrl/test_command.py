"""The preamble `agentrl up`, `serve` and `eval` share: settings errors exit 2, SIGTERM stops like Ctrl-C."""

from __future__ import annotations

import argparse
import os
import signal
from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from agentrl.command import add_command, run_command, sigterm_as_interrupt
from agentrl.settings import SettingsError


@dataclass
class Knobs:
    env_prefix: ClassVar[str] = "AGENTRL_TEST_KNOBS_"
    n: int = field(default=1, metadata={"help": "how many"})

    def validate(self) -> None:
        if self.n < 0:
            raise SettingsError("--n must be 0 or more")


def _parse(argv: list[str], main) -> int:
    parser = argparse.ArgumentParser(prog="agentrl")
    sub = parser.add_subparsers(dest="command", required=True)
    add_command(sub, "knobs", Knobs, lambda args: run_command("knobs", Knobs, args, main, errors={LookupError: 3}),
                help="a test command", description=None)
    args = parser.parse_args(argv)
    return args.func(args)


def test_settings_errors_and_declared_errors_exit_with_their_status(capsys):
    assert _parse(["knobs", "--n", "2"], lambda s: s.n) == 2
    assert _parse(["knobs", "--n", "-1"], lambda s: 0) == 2
    assert "agentrl knobs: --n must be 0 or more" in capsys.readouterr().err

    def missing(settings):
        raise KeyError("no such task")

    assert _parse(["knobs"], missing) == 3
    assert "agentrl knobs: 'no such task'" in capsys.readouterr().err


def test_sigterm_stops_the_command_as_ctrl_c_does(capsys):
    def killed(settings):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler raises at the next bytecode
        signal.pause()  # not reached: KeyboardInterrupt has left main
        return 0

    before = signal.getsignal(signal.SIGTERM)
    assert _parse(["knobs"], killed) == 130
    assert "agentrl knobs: interrupted; every process it started has been stopped" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before  # restored after the command


def test_a_second_sigterm_does_not_cut_the_stop_short():
    stopped = []
    with pytest.raises(KeyboardInterrupt):
        with sigterm_as_interrupt():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                signal.pause()
            finally:  # what `with Processes(...)` does on the way out: a second SIGTERM must not interrupt it
                os.kill(os.getpid(), signal.SIGTERM)
                stopped.append(True)
    assert stopped == [True]
