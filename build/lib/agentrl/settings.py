"""Typed settings for every process, from flags, environment variables and an optional YAML file.

Each process declares one dataclass; every field carries its help text in ``metadata["help"]``. Values are
taken, highest first, from command-line flags, environment variables (``<env_prefix><FIELD>``, e.g.
``AGENTRL_GATEWAY_PORT``), the YAML file given with ``--config``, then the field default. The dataclass's
``validate()`` fills derived values and rejects bad combinations with a message that says how to fix them.

    @dataclass
    class EngineSettings:
        env_prefix: ClassVar[str] = "AGENTRL_ENGINE_"
        model: str = field(default="smollm2", metadata={"help": "smollm2, tiny or a HF model directory"})

    add_arguments(parser, EngineSettings)      # adds --model, --config
    settings = load(EngineSettings, args)      # flags > env > YAML > defaults, then validate()
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class SettingsError(ValueError):
    """A setting is missing, malformed or inconsistent; the message says how to fix it."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(element type, is_list) for str/int/float/bool/Path, their Optionals and list[...] of them."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    if origin in (list, tuple):
        return typing.get_args(tp)[0], True
    return tp, False


def _convert(name: str, raw: Any, tp: Any) -> Any:
    base, is_list = _base_type(tp)
    if raw is None:
        return None
    if is_list:
        items = raw if isinstance(raw, (list, tuple)) else [s for s in str(raw).split(",") if s.strip()]
        return [_convert(name, item, base) for item in items]
    try:
        if base is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if base in (int, float, str, Path):
            return base(raw)
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"setting {name}: {raw!r} is not a valid {getattr(base, '__name__', base)}") from exc
    return raw


def env_names(cls: type) -> dict[str, str]:
    """Environment variable name of every field (used by tests that check deployment files)."""
    prefix = getattr(cls, "env_prefix", "AGENTRL_")
    return {f.name: prefix + f.name.upper() for f in dataclasses.fields(cls)}


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per field (default None, so that env/YAML/defaults apply when it is absent)."""
    hints = _field_types(cls)
    envs = env_names(cls)
    for f in dataclasses.fields(cls):
        base, is_list = _base_type(hints[f.name])
        help_text = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        help_text = f"{help_text} [env {envs[f.name]}; default {default!r}]"
        flags = [_flag(f.name), *f.metadata.get("aliases", ())]
        if base is bool and not is_list:
            parser.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        elif is_list:
            parser.add_argument(*flags, dest=f.name, action="append", default=None, help=help_text + " (repeatable or comma-separated)")
        else:
            parser.add_argument(*flags, dest=f.name, default=None, help=help_text,
                                choices=f.metadata.get("choices"))
    if not any(a.dest == "config" for a in parser._actions):
        parser.add_argument("--config", default=None, help="YAML file with settings (flags and env override it)")


def load(cls: type[T], args: argparse.Namespace | None = None, *, yaml_path: str | Path | None = None,
         env: dict[str, str] | None = None, **overrides: Any) -> T:
    """Build and validate settings: overrides/flags > environment > YAML > defaults."""
    env = os.environ if env is None else env
    hints = _field_types(cls)
    names = env_names(cls)
    yaml_path = yaml_path or (getattr(args, "config", None) if args is not None else None)
    from_yaml: dict[str, Any] = {}
    if yaml_path:
        import yaml

        try:
            loaded = yaml.safe_load(Path(yaml_path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise SettingsError(f"cannot read settings file {yaml_path}: {exc}") from exc
        if not isinstance(loaded, dict):
            raise SettingsError(f"settings file {yaml_path} must hold a mapping of setting: value")
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(k.replace("-", "_") for k in loaded) - valid)
        if unknown:
            raise SettingsError(f"settings file {yaml_path}: unknown settings {unknown}; valid: {sorted(valid)}")
        from_yaml = {k.replace("-", "_"): v for k, v in loaded.items()}
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        raw: Any = None
        if f.name in overrides and overrides[f.name] is not None:
            raw = overrides[f.name]
        elif args is not None and getattr(args, f.name, None) is not None:
            raw = getattr(args, f.name)
            _, is_list = _base_type(hints[f.name])
            if is_list:  # flattened: --x a --x b,c -> [a, b, c]
                raw = [item for chunk in raw for item in (chunk if isinstance(chunk, list) else str(chunk).split(",")) if item]
        elif names[f.name] in env:
            raw = env[names[f.name]]
        elif f.name in from_yaml:
            raw = from_yaml[f.name]
        else:
            continue
        values[f.name] = _convert(_flag(f.name), raw, hints[f.name])
    try:
        settings = cls(**values)
    except TypeError as exc:
        raise SettingsError(str(exc)) from exc
    validate = getattr(settings, "validate", None)
    if validate is not None:
        validate()
    return settings
