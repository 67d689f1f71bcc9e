"""`agentrl engine` settings: flags > AGENTRL_ENGINE_* > YAML > defaults, refused with a how-to-fix message."""

from __future__ import annotations

import argparse

import pytest

from agentrl.settings import SettingsError, add_arguments, load
from engine.config import EngineSettings


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineSettings)
    return parser.parse_args(argv)


def test_flags_override_environment_and_defaults(tmp_path):
    env = {"AGENTRL_ENGINE_PORT": "31000", "AGENTRL_ENGINE_MAX_RUNNING_REQUESTS": "8"}
    settings = load(EngineSettings, parse(["--model", "tiny", "--max-running-requests", "4"]), env=env)
    assert (settings.model, settings.port, settings.max_running_requests) == ("tiny", 31000, 4)
    assert settings.context_length is None and settings.device == "cpu"
    config = tmp_path / "engine.yaml"
    config.write_text("context_length: 512\nport: 1\n")
    from_yaml = load(EngineSettings, parse(["--config", str(config)]), env=env)
    assert from_yaml.context_length == 512 and from_yaml.port == 31000  # env beats YAML


@pytest.mark.parametrize("argv, fragment", [
    (["--port", "70000"], "--port"),
    (["--max-running-requests", "0"], "--max-running-requests"),
    (["--context-length", "1"], "context_length"),
])
def test_bad_settings_say_how_to_fix_them(argv, fragment):
    with pytest.raises(SettingsError) as info:
        load(EngineSettings, parse(argv), env={})
    assert fragment in str(info.value)
