"""docker-compose.yml, .env.example and docker/Dockerfile checked against the real CLI and settings.

No Docker engine is needed: the file is read with PyYAML and interpolated with .env.example's values, every
``agentrl`` command line is parsed with the real ``agentrl`` parser, every ``AGENTRL_*`` variable is looked up
in the settings dataclasses. ``docker compose config`` (or the standalone ``docker-compose config``) runs too
where a Compose CLI is installed; it needs no engine.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from urllib.parse import urlparse

import pytest

from agentrl.cli import build_parser
from tests.deploy.compose_file import (
    COMPOSE,
    ENV_EXAMPLE,
    REPO,
    argv,
    class_env_names,
    compose,
    direct_env_vars,
    environment,
    known_env_vars,
    raw_compose,
    read_env_file,
    settings_classes,
)

SERVICES = ("postgres", "redis", "sglang", "gateway", "trainer", "agent")


@pytest.fixture(scope="module")
def services() -> dict:
    return compose()["services"]


def flag_value(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


def agentrl_argv(args: list[str]) -> list[str] | None:
    """The arguments of the `agentrl` parser for a service's command, or None if it runs something else."""
    if args[:1] == ["agentrl"]:
        return args[1:]
    if args[:1] == ["torchrun"]:
        assert "-m" in args, f"torchrun without -m: {args}"
        i = args.index("-m")
        assert args[i + 1] == "trainer", f"torchrun must run -m trainer: {args}"
        return ["train", *args[i + 2:]]
    return None


def test_every_service_is_there(services):
    assert set(SERVICES) <= set(services), sorted(set(SERVICES) - set(services))
    assert raw_compose()["services"]["agent"].get("profiles") == ["agent"]


@pytest.mark.parametrize("name", ["gateway", "trainer", "agent"])
def test_agentrl_command_lines_parse_with_the_real_cli(services, name):
    args = agentrl_argv(argv(services[name]))
    assert args is not None, f"{name} does not run agentrl: {argv(services[name])}"
    parser = build_parser()
    try:
        parsed = parser.parse_args(args)
    except SystemExit as exc:  # argparse printed which flag it refused
        pytest.fail(f"{name}: `agentrl {' '.join(args)}` is refused by the real CLI (exit {exc.code})")
    assert parsed.command == args[0]
    # every flag used is one the subcommand's --help lists
    sub = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == args[0])[1]
    known = {opt for action in sub._actions for opt in action.option_strings}
    used = {a for a in args if a.startswith("--")}
    assert used <= known, f"{name}: flags unknown to `agentrl {args[0]}`: {sorted(used - known)}"


def test_every_agentrl_env_var_exists_in_the_settings(services):
    known = known_env_vars()
    assert known, "no settings classes found"
    used: dict[str, str] = {}
    for name, service in services.items():
        for var in environment(service):
            if var.startswith("AGENTRL_"):
                used[var] = f"docker-compose.yml service {name}"
    active, commented = read_env_file()
    for var in {**active, **commented}:
        if var.startswith("AGENTRL_"):
            used[var] = ".env.example"
    unknown = {var: where for var, where in used.items() if var not in known}
    assert not unknown, f"AGENTRL_* variables that no settings class reads: {unknown}"


def test_env_example_documents_every_setting():
    active, commented = read_env_file()
    listed = set(active) | set(commented)
    every = {var for cls in settings_classes() for var in class_env_names(cls).values()} | set(direct_env_vars())
    missing = every - listed
    assert not missing, f".env.example lacks {sorted(missing)} (regenerate: python docker/make_env_example.py)"
    # each NAME= line has a comment above it
    lines = ENV_EXAMPLE.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^#?\s*[A-Z][A-Z0-9_]*=", line) and not line.startswith("# "):
            assert i > 0 and lines[i - 1].startswith("#"), f".env.example line {i + 1} has no comment: {line}"


def test_compose_variables_have_values_in_env_example():
    active, _ = read_env_file()
    text = COMPOSE.read_text()
    required = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*):\?", text))
    assert required <= set(active), f"required variables missing from .env.example: {sorted(required - set(active))}"
    used = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", text))
    _, commented = read_env_file()
    undocumented = used - set(active) - set(commented)
    assert not undocumented, f"variables of docker-compose.yml not in .env.example: {sorted(undocumented)}"


def test_health_checks_and_start_order(services):
    for name in ("postgres", "redis", "sglang", "gateway"):
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no health check"
    assert "/health" in " ".join(services["sglang"]["healthcheck"]["test"])
    assert "/health" in " ".join(services["gateway"]["healthcheck"]["test"])
    expected = {
        "gateway": {"postgres", "redis", "sglang"},
        "trainer": {"gateway", "sglang"},
        "agent": {"gateway"},
    }
    for name, deps in expected.items():
        depends = services[name].get("depends_on", {})
        assert isinstance(depends, dict), f"{name}: depends_on needs conditions"
        for dep in deps:
            assert depends.get(dep, {}).get("condition") == "service_healthy", f"{name} must wait for healthy {dep}"


def test_gateway_is_wired_to_sglang_postgres_and_redis(services):
    args = argv(services["gateway"])
    for url in flag_value(args, "--engine-url").split(","):
        parsed = urlparse(url)
        assert parsed.hostname in services, f"engine url {url} names no service"
        assert str(parsed.port) in argv(services[parsed.hostname]), f"{url}: port not served by {parsed.hostname}"
    db = urlparse(flag_value(args, "--db"))
    assert db.scheme == "postgresql+asyncpg" and db.hostname == "postgres"
    assert urlparse(flag_value(args, "--redis")).hostname == "redis"
    assert flag_value(args, "--host") == "0.0.0.0"


def test_group_size_agrees_between_agent_gateway_and_trainer(services):
    """The gateway cuts groups of its group size; the agent makes groups of --group-size; the trainer expects
    groups of --group-size. A mismatch leaves groups that never fill."""
    agent = flag_value(argv(services["agent"]), "--group-size")
    assert flag_value(argv(services["trainer"]), "--group-size") == agent
    assert environment(services["gateway"])["AGENTRL_GATEWAY_GROUP_SIZE"] == agent


def test_sglang_serves_tokens_and_weight_updates(services):
    args = argv(services["sglang"])
    assert args[:3] == ["python3", "-m", "sglang.launch_server"]
    assert "--skip-tokenizer-init" not in args, "the detokenizer is needed for stop strings and text"
    assert flag_value(args, "--weight-version") == "0", "versions are integers starting at 0 in agentrl"
    assert flag_value(args, "--host") == "0.0.0.0"
    assert "--enable-deterministic-inference" in args, "without it SGLang ignores sampling_seed (OpenAI seed)"
    assert "--stream-output" not in args and "--incremental-streaming-output" not in args  # cumulative chunks
    assert raw_compose()["services"]["sglang"]["image"].startswith("lmsysorg/sglang:${SGLANG_TAG")
    for name in ("sglang", "trainer"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert any("gpu" in d.get("capabilities", []) for d in devices), f"{name} reserves no GPU"


def _mounts(service: dict) -> dict[str, tuple[str, bool]]:
    """container path -> (source, read_only)"""
    out = {}
    for vol in service.get("volumes", []):
        parts = vol.split(":") if isinstance(vol, str) else [vol["source"], vol["target"]]
        out[parts[1]] = (parts[0], len(parts) > 2 and "ro" in parts[2].split(","))
    return out


def test_weights_and_checkpoints_pass_through_shared_volumes(services):
    declared = compose()["volumes"]
    for name in ("pgdata", "redisdata", "weights", "checkpoints"):
        assert name in declared, f"named volume {name} missing"
    assert _mounts(services["postgres"])["/var/lib/postgresql/data"][0] == "pgdata"
    assert _mounts(services["redis"])["/data"][0] == "redisdata"
    trainer, sglang = _mounts(services["trainer"]), _mounts(services["sglang"])
    weights_dir = flag_value(argv(services["trainer"]), "--sync-dir")
    # the trainer writes weights where SGLang reads them, under the same path (the path travels in the
    # /update_weights_from_disk request)
    assert trainer[weights_dir] == ("weights", False)
    assert sglang[weights_dir][0] == "weights"
    assert trainer[flag_value(argv(services["trainer"]), "--checkpoint-dir")][0] == "checkpoints"
    # one model directory for the engine, the gateway's tokenizer and the trainer
    model = flag_value(argv(services["sglang"]), "--model-path")
    assert flag_value(argv(services["gateway"]), "--tokenizer") == model
    assert flag_value(argv(services["trainer"]), "--model") == model
    for name in ("sglang", "gateway", "trainer"):
        assert any(model.startswith(path + "/") for path in _mounts(services[name])), f"{name} cannot see {model}"


def test_dockerfile_targets_and_copied_paths_exist():
    text = (REPO / "docker" / "Dockerfile").read_text()
    targets = set(re.findall(r"^FROM \S+ AS (\S+)", text, re.M))
    assert {"gateway", "trainer"} <= targets
    for build_target in ("gateway", "trainer"):
        assert raw_compose()["services"][build_target]["build"]["target"] == build_target
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
    for src in re.findall(r"^COPY (?!--from)(\S+) ", text, re.M):
        for path in src.split():
            assert (REPO / path).exists(), f"Dockerfile copies {path}, which is not in the repository"
            assert path not in ignored, f"{path} is excluded by .dockerignore"
    # the installed packages are the ones pyproject.toml lists
    import tomllib

    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    for pattern in packages:
        assert f"COPY {pattern.rstrip('*')} " in text, f"Dockerfile does not copy package {pattern}"


def _compose_cli() -> list[str] | None:
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_docker_compose_config_accepts_the_file(tmp_path):
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no Compose CLI here (neither `docker compose` nor `docker-compose`)")
    shutil.copy(COMPOSE, tmp_path / "docker-compose.yml")
    shutil.copy(ENV_EXAMPLE, tmp_path / ".env")
    result = subprocess.run([*cli, "--profile", "agent", "config"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "sglang" in result.stdout and "trainer" in result.stdout and "agent" in result.stdout
