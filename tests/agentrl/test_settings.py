import argparse
from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from agentrl.settings import SettingsError, add_arguments, env_names, load


@dataclass
class Demo:
    env_prefix: ClassVar[str] = "AGENTRL_DEMO_"
    port: int = field(default=1, metadata={"help": "port"})
    urls: list[str] = field(default_factory=list, metadata={"help": "urls"})
    fast: bool = field(default=False, metadata={"help": "fast"})
    name: str = field(default="x", metadata={"help": "name"})

    def validate(self) -> None:
        if self.port <= 0:
            raise SettingsError("--port must be positive; pass e.g. --port 8000")


def parse(argv, **kw):
    parser = argparse.ArgumentParser()
    add_arguments(parser, Demo)
    return load(Demo, parser.parse_args(argv), **kw)


def test_precedence_flags_env_yaml_default(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("port: 3\nname: fromyaml\nfast: true\n")
    s = parse(["--config", str(cfg), "--port", "5"], env={"AGENTRL_DEMO_NAME": "fromenv"})
    assert (s.port, s.name, s.fast) == (5, "fromenv", True)
    assert parse([], env={}).port == 1


def test_lists_repeatable_and_comma_separated():
    s = parse(["--urls", "a,b", "--urls", "c"], env={})
    assert s.urls == ["a", "b", "c"]
    assert parse([], env={"AGENTRL_DEMO_URLS": "x,y"}).urls == ["x", "y"]


def test_errors_say_what_is_wrong(tmp_path):
    with pytest.raises(SettingsError, match="not a valid int"):
        parse(["--port", "abc"], env={})
    with pytest.raises(SettingsError, match="must be positive"):
        parse(["--port", "0"], env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("prot: 3\n")
    with pytest.raises(SettingsError, match="unknown settings \\['prot'\\]"):
        parse(["--config", str(bad)], env={})
    assert env_names(Demo)["port"] == "AGENTRL_DEMO_PORT"
