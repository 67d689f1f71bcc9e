"""Read docker-compose.yml and .env.example the way Compose does, for the deployment tests.

Compose interpolates ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?message}`` and ``$$`` in
every string of the file, from the environment and the ``.env`` file. The tests interpolate with the values
of ``.env.example``, so they check the command lines a user gets after ``cp .env.example .env``.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / ".env.example"

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_ENV_LINE = re.compile(r"^\s*(#\s*)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def read_env_file(path: Path = ENV_EXAMPLE) -> tuple[dict[str, str], dict[str, str]]:
    """(set, commented_out): the NAME=value lines of a .env file, active ones and ``# NAME=value`` ones."""
    active: dict[str, str] = {}
    commented: dict[str, str] = {}
    for line in path.read_text().splitlines():
        m = _ENV_LINE.match(line)
        if not m:
            continue
        value = m.group(3).strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        (commented if m.group(1) else active)[m.group(2)] = value
    return active, commented


def interpolate(text: str, env: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3)
        value = env.get(name)
        if op in (":-", "-"):
            if value is None or (op == ":-" and value == ""):
                return arg
        elif op in (":?", "?"):
            if value is None or (op == ":?" and value == ""):
                raise KeyError(f"{name} is required: {arg}")
        return value if value is not None else ""

    return _VAR.sub(sub, text)


def interpolate_tree(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [interpolate_tree(item, env) for item in node]
    if isinstance(node, dict):
        return {key: interpolate_tree(value, env) for key, value in node.items()}
    return node


def raw_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    """docker-compose.yml interpolated with .env.example (or ``env``)."""
    return interpolate_tree(raw_compose(), read_env_file()[0] if env is None else env)


def argv(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    if isinstance(command, str):
        import shlex

        return shlex.split(command)
    return [str(part) for part in command]


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {}) or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}


PACKAGES = ("agentrl", "engine", "gateway", "trainer", "agents")
_CLASSVAR_PREFIX = re.compile(r"^\s+env_prefix\s*:\s*ClassVar", re.M)
_MODULE_PREFIX = re.compile(r"^ENV_PREFIX\s*=\s*[\"'](AGENTRL_[A-Z0-9_]*)[\"']", re.M)
_DIRECT_VAR = re.compile(r"(?:environ\.get\(|environ\[|getenv\()\s*[\"'](AGENTRL_[A-Z0-9_]+)[\"']")


def _sources() -> list[tuple[str, str]]:
    out = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            out.append((".".join(path.relative_to(REPO).with_suffix("").parts), path.read_text()))
    return out


def settings_classes() -> list[type]:
    """Every settings dataclass of the project, found by reading the source: classes with an ``env_prefix``
    ClassVar (the convention of agentrl.settings), and dataclasses of a module that reads its fields from
    the environment under a module-level ``ENV_PREFIX`` (gateway.lifecycle.ExportSettings)."""
    found: dict[str, type] = {}
    for name, text in _sources():
        module_prefix = _MODULE_PREFIX.search(text)
        if not (_CLASSVAR_PREFIX.search(text) or module_prefix):
            continue
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if not (isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == name):
                continue
            if isinstance(getattr(obj, "env_prefix", None), str) or (module_prefix and obj.__name__.endswith("Settings")):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return list(found.values())


def class_env_names(cls: type) -> dict[str, str]:
    """field -> environment variable, for either kind of settings class."""
    prefix = getattr(cls, "env_prefix", None) or getattr(importlib.import_module(cls.__module__), "ENV_PREFIX")
    return {f.name: prefix + f.name.upper() for f in dataclasses.fields(cls)}


def direct_env_vars() -> dict[str, str]:
    """AGENTRL_* variables read directly with os.environ / getenv (not through a settings class) -> module."""
    return {var: name for name, text in _sources() for var in _DIRECT_VAR.findall(text)}


def known_env_vars() -> dict[str, object]:
    known: dict[str, object] = {var: cls for cls in settings_classes() for var in class_env_names(cls).values()}
    known.update(direct_env_vars())
    return known
