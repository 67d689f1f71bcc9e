"""Parses SGLang launch command lines with one release's own argument parser (``ServerArgs.add_cli_args``).

Run as a script with that release's wheel on ``PYTHONPATH`` (``.venv/sglang-X``, installed ``--no-deps``):

    PYTHONPATH=.venv/sglang-0.5.23 python -m tests.sglang.server_args '["--model-path", "/m", ...]' ...

Each argument is one command line as a JSON list; one JSON line per command line comes out:
``{"ok": true, "args": {...}}`` or ``{"ok": false, "error": "..."}`` (argparse's own message).

The parser's module imports packages the venv does not have (the wheel's dependencies are not installed) and
never calls them while it builds the parser: those, and only those, become empty modules (``STUBBED``). They are
only ever reached after every real finder has failed, so nothing the venv has is replaced. transformers decides at
import whether torchvision exists, so it is imported before any stub can answer for torchvision.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.machinery
import io
import json
import sys
import types

# imported by sglang/srt/utils and server_args' import chain at module level, unused by the argument parser
STUBBED = frozenset({"pybase64", "IPython", "aiohttp", "torchvision", "partial_json_parser"})


class _Empty(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__init__": lambda self, *a, **k: None})
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path=None, target=None):
        if name.split(".")[0] not in STUBBED:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = _Empty(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


class _Refused(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse exits; one refused command line must not end the others
        raise _Refused(message)


def parse(command_lines: list[list[str]]) -> list[dict]:
    import transformers.utils.import_utils  # noqa: F401  (decides torchvision's absence before the stubs exist)

    sys.meta_path.append(_StubFinder())  # last: reached only for modules no real finder has
    from sglang.srt.server_args import ServerArgs

    results = []
    for argv in command_lines:
        parser = _Parser(prog="sglang.launch_server")
        ServerArgs.add_cli_args(parser)
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                args = parser.parse_args(argv)
        except _Refused as exc:
            results.append({"ok": False, "error": str(exc)})
            continue
        results.append({"ok": True, "args": {k: v for k, v in vars(args).items()
                                             if isinstance(v, (str, int, float, bool, type(None)))}})
    return results


if __name__ == "__main__":
    for result in parse([json.loads(arg) for arg in sys.argv[1:]]):
        print(json.dumps(result))
