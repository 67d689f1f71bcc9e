"""The command lines `agentrl up`, `serve` and `eval` give their children, read by the children's own parsers.

`secrets.token_urlsafe` starts with ``-`` once in 64 draws, and ``--admin-key -x...`` is read by argparse
as a missing value followed by an unknown option (`agentrl up` failed at once that way on 2026-12-04). The
keys here start with ``-`` on purpose; each command line goes through `agentrl.cli.build_parser()` (the
parser `python -m agentrl` runs) and the child's settings loader.
"""

from __future__ import annotations

import pytest

from agentrl.cli import build_parser
from agentrl.keys import new_key
from agentrl.settings import load
from agentrl.stack import engine_argv, gateway_argv
from engine.config import EngineSettings
from gateway.settings import GatewaySettings
from trainer.config import TrainerSettings

ADMIN, RUNNER, AGENT = "-Adm1n_key-", "--runner-key", "-agentKey"  # the worst a key could look like


def parsed(argv: list[str], settings: type):
    return load(settings, build_parser().parse_args(argv), env={})


def test_the_bug_the_flags_form_avoids():
    with pytest.raises(SystemExit):  # what `agentrl up` used to build: the key read as an option
        build_parser().parse_args(["gateway", "--engine-url", "http://e", "--admin-key", ADMIN])


def test_up_builds_command_lines_its_children_parse_with_keys_starting_with_a_dash(tmp_path):
    from agentrl.up import Keys, UpSettings, child_argvs

    settings = load(UpSettings, env={}, out_dir=str(tmp_path), keep_checkpoints=3)
    argvs = child_argvs(settings, tmp_path, Keys(ADMIN, RUNNER), engine_url="http://127.0.0.1:9", gateway_port=8123)

    gateway = parsed(argvs["gateway"], GatewaySettings)
    assert (gateway.admin_key, gateway.runner_key, gateway.port) == (ADMIN, [RUNNER], 8123)
    assert gateway.engine_url == ["http://127.0.0.1:9"] and gateway.gamma == settings.gamma

    trainer = parsed(argvs["trainer"], TrainerSettings)
    assert (trainer.admin_key, trainer.gateway) == (ADMIN, "http://127.0.0.1:8123")
    assert trainer.resume is False and trainer.steps == settings.steps and trainer.sync_mode == "disk"
    assert trainer.keep_checkpoints == 3 and trainer.save_optimizer is False  # weights-only unless asked

    asked = load(UpSettings, env={}, out_dir=str(tmp_path), save_optimizer=True)
    argvs = child_argvs(asked, tmp_path, Keys(ADMIN, RUNNER), engine_url="http://e", gateway_port=1)
    assert parsed(argvs["trainer"], TrainerSettings).save_optimizer is True


def test_serve_builds_command_lines_its_children_parse_with_keys_starting_with_a_dash(tmp_path):
    from agentrl.serve import ServeSettings, child_argvs

    # the keys a user passes the same way: `agentrl serve --admin-key=-Adm1n_key-`
    settings = parsed(["serve", f"--admin-key={ADMIN}", f"--agent-key={AGENT}", "--port", "8765",
                       "--out-dir", str(tmp_path)], ServeSettings)
    assert (settings.admin_key, settings.agent_key) == (ADMIN, AGENT)
    argvs = child_argvs(settings, tmp_path, engine_url="http://127.0.0.1:9")

    gateway = parsed(argvs["gateway"], GatewaySettings)
    assert (gateway.admin_key, gateway.agent_key, gateway.port) == (ADMIN, [AGENT], 8765)
    assert gateway.public_url == "http://127.0.0.1:8765"
    trainer = parsed(argvs["trainer"], TrainerSettings)
    assert (trainer.admin_key, trainer.gateway, trainer.save_every) == (ADMIN, "http://127.0.0.1:8765", 10)
    assert trainer.save_optimizer is False and trainer.keep_checkpoints == 2


def test_eval_and_engine_command_lines_parse_too(tmp_path):
    engine = parsed(engine_argv(model="tiny", port=8124, device="cpu", max_running_requests=8), EngineSettings)
    assert (engine.model, engine.port, engine.max_running_requests) == ("tiny", 8124, 8)
    gateway = parsed(gateway_argv(engine_url="http://e:1", db=f"sqlite+aiosqlite:///{tmp_path}/g.db", port=8125,
                                  admin_key=ADMIN), GatewaySettings)
    assert gateway.admin_key == ADMIN


def test_made_keys_never_start_with_a_dash(monkeypatch):
    import secrets

    monkeypatch.setattr(secrets, "token_urlsafe", lambda n: "-starts-with-a-dash")  # the 1-in-64 draw
    for role in ("admin", "agent", "runner"):
        key = new_key(role)
        assert key == f"{role}--starts-with-a-dash"
        assert parsed(["gateway", "--engine-url", "http://e", "--admin-key", key], GatewaySettings).admin_key == key
    with pytest.raises(ValueError, match="unknown key role"):
        new_key("-x")
