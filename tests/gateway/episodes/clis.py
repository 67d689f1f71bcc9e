"""The real coding CLIs for the end-to-end tests: Claude Code and Codex from npm, and an engine that
answers them by what their prompt asks for.

``installed_clis()`` finds ``claude`` and ``codex`` under ``AGENTRL_CLIS_PREFIX`` (default
``~/.cache/agentrl/clis``, where ``.ci/run`` installs them) or installs them there with npm, pinned to the
versions the captures came from; it returns None with the reason when npm cannot be reached, and the tests
skip saying so.

``ByPrompt`` is the engine transport: a random tiny model cannot be made to call ``Agent``, so each
``/generate`` goes to one of several scripted stand-ins (``tests.standin``, one reply each) chosen by the
decoded prompt's last message: the real CLIs may send their requests in any order and number, and each
gets the answer its state calls for.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

VERSIONS = {"claude": "@anthropic-ai/claude-code@2.1.197", "codex": "@openai/codex@0.171.0"}


def prefix() -> Path:
    return Path(os.environ.get("AGENTRL_CLIS_PREFIX", Path.home() / ".cache" / "agentrl" / "clis"))


def installed_clis() -> tuple[dict[str, str] | None, str]:
    """({name: path}, "") or (None, why not)."""
    bins = prefix() / "node_modules" / ".bin"
    found = {name: str(bins / name) for name in VERSIONS if (bins / name).exists()}
    if len(found) == len(VERSIONS):
        return found, ""
    npm = shutil.which("npm")
    if npm is None:
        return None, "npm is not installed"
    try:
        done = subprocess.run([npm, "install", "--prefix", str(prefix()), "--no-audit", "--no-fund",
                               *VERSIONS.values()], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return None, "npm install of the CLIs did not finish in 15 minutes"
    if done.returncode != 0:
        return None, f"npm install of the CLIs failed (no registry?): {done.stderr.strip()[-300:]}"
    found = {name: str(bins / name) for name in VERSIONS if (bins / name).exists()}
    return (found, "") if len(found) == len(VERSIONS) else (None, "npm installed no CLI binaries")


class ByPrompt(httpx.AsyncBaseTransport):
    """Route each ``/generate`` to the stand-in named by ``choose(prompt text)``; other calls to the first.
    ``choose`` may also return a reply text that is not a name: a stand-in for it is made on first use."""

    def __init__(self, apps: dict[str, Any], tokenizer: Any, choose: Callable[[str], str],
                 make: Callable[[str], Any] | None = None) -> None:
        self.transports = {k: httpx.ASGITransport(app=a) for k, a in apps.items()}
        self.first = next(iter(self.transports.values()))
        self.tokenizer, self.choose, self.make = tokenizer, choose, make
        self.chosen: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate":
            ids = json.loads(request.content).get("input_ids") or []
            key = self.choose(self.tokenizer.decode(ids[-4000:], skip_special_tokens=False))
            self.chosen.append(key)
            if key not in self.transports and self.make is not None:
                self.transports[key] = httpx.ASGITransport(app=self.make(key))
            return await self.transports[key].handle_async_request(request)
        return await self.first.handle_async_request(request)


def last_message(prompt: str) -> str:
    """The text of the last message before the generation prompt (ChatML: ``<|im_start|>role ...``)."""
    turns = prompt.split("<|im_start|>")
    return turns[-2] if len(turns) >= 2 else prompt
