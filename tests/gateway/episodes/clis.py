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

The Claude Code task (``TASK``, ``PROMPT``, ``REPLIES``, ``Script``), ``claude_command`` and ``served`` (the
gateway in-process on a real socket over a ``ByPrompt`` engine) are shared by ``test_real_clis.py`` and the
trainer step over the real CLI's rows (``test_train_step.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.settings import GatewaySettings
from tests.gateway.episodes.conftest import ADMIN, AGENT
from tests.inprocess import serve
from tests.standin import build_app

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


# ------------------------------------------------- the Claude Code task and the gateway the CLIs talk to

CONTEXT = 131072
TASK = "SUBTASK-7f3a: create a file hello.txt in the current directory containing exactly hi, then report done."
PROMPT = ("Use a sub-agent (the Agent tool) to create a file named hello.txt in the current directory containing "
          "exactly the word hi, then reply done.")


def call(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


REPLIES = {
    "agent": "I'll delegate this to a sub-agent.\n" + call("Agent", {"description": "Create hello file", "prompt": TASK,
                                                                     "subagent_type": "general-purpose"}),
    "bash_hi": call("Bash", {"command": "printf 'hi\\n' > hello.txt", "description": "Create hello.txt"}),
    "bash_bye": call("Bash", {"command": "printf 'bye\\n' > hello.txt", "description": "Create hello.txt"}),
    "done": "Done.",
}


class Script:
    """Which reply a prompt gets: a thread that has answered before (an assistant turn before the one being
    generated) is done; a thread's first turn calls ``Bash`` if its task is the sub-agent's, else ``Agent``
    (the CLIs add reminders and system messages after tool results, so the prompt's structure is read, not
    its last message)."""

    def __init__(self) -> None:
        self.bash = 0

    def __call__(self, prompt: str) -> str:
        if prompt.count("<|im_start|>assistant") > 1:
            return "done"
        if TASK in prompt:
            self.bash += 1
            return "bash_hi" if self.bash % 2 else "bash_bye"
        return "agent"


@asynccontextmanager
async def served(tiny_model_dir: Path, tok: Any, tmp_path: Path, engine: ByPrompt | None = None,
                 wrap: Callable[[Any], Any] | None = None,
                 context: int = CONTEXT) -> AsyncIterator[tuple[str, Any, ByPrompt]]:
    """The gateway on a real socket; ``wrap``: an ASGI middleware around it (to watch what reaches it);
    ``context``: the gateway's context length (the stand-ins' stays ``CONTEXT``)."""
    engine = engine or ByPrompt({k: build_app(str(tiny_model_dir), [v], tokenizer=tok, context_length=CONTEXT)
                                 for k, v in REPLIES.items()}, tok, Script())
    settings = GatewaySettings(engine_url=["http://engine"], db=f"sqlite+aiosqlite:///{tmp_path}/gw.db",
                               admin_key=ADMIN, agent_key=[AGENT], health_interval_s=3600, context_length=context)
    settings.validate()
    async with httpx.AsyncClient(transport=engine, timeout=120) as engine_http:
        app = create_app(settings, http=engine_http, tokenizer=tok)
        async with app.router.lifespan_context(app), serve(wrap(app) if wrap else app) as base:
            yield base, app, engine


CLAUDE_ENV = ("HOME=\"$AGENTRL_WORKDIR/../home\" CLAUDE_CONFIG_DIR=\"$AGENTRL_WORKDIR/../home/.claude\" TERM=dumb "
              "DISABLE_TELEMETRY=1 DISABLE_AUTOUPDATER=1 DISABLE_ERROR_REPORTING=1 DISABLE_BUG_COMMAND=1 "
              "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_GROWTHBOOK=1 DISABLE_UPDATES=1 "
              "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY=1 DISABLE_COST_WARNINGS=1 DISABLE_INSTALLATION_CHECKS=1 "
              "CLAUDE_CODE_DISABLE_OFFICIAL_MARKETPLACE_AUTOINSTALL=1 CLAUDE_CODE_MAX_RETRIES=1")
CLAUDE_HOME = 'mkdir -p "$AGENTRL_WORKDIR/../home"'


def claude_run(claude: str, prompt: str, *extra: str) -> str:
    """One ``claude -p`` run as a shell command: Claude Code as the capture kit ran it, in the attempt's own
    home and directory; ``extra``: more of its arguments (quoted here)."""
    args = " ".join(shlex.quote(a) for a in [claude, "-p", prompt, "--output-format", "json", "--permission-mode",
                                              "acceptEdits", "--allowedTools", "Bash", "Write", "Edit", "Read",
                                              "Agent", "Task", *extra])
    return f"{CLAUDE_ENV} {args}"


def claude_command(claude: str, *extra: str) -> list[str]:
    """One attempt: one run on ``PROMPT``, no session kept on disk; ``extra``: more of its arguments."""
    return ["sh", "-c", f"{CLAUDE_HOME} && {claude_run(claude, PROMPT, '--no-session-persistence', *extra)}"]


CODEX_PROMPT = ("Spawn a sub-agent to create a file named hello.txt in the current directory containing exactly "
                "the word hi, wait for it, then reply done.")
# Codex's provider: the gateway as a custom Responses provider reading the attempt's bound URL and key
GATEWAY_PROVIDER = ('model_provider = "gateway"\n[model_providers.gateway]\nname = "gateway"\n'
                    'base_url = "$OPENAI_BASE_URL"\nenv_key = "OPENAI_API_KEY"\nwire_api = "responses"\n'
                    'request_max_retries = 1\nstream_max_retries = 1\nsupports_websockets = false\n')

# or Codex's built-in provider pointed at the gateway (Responses WebSocket tried first, remote compaction v2);
# it takes its key from CODEX_API_KEY (``codex exec``), not OPENAI_API_KEY
OPENAI_PROVIDER = 'model_provider = "openai"\nopenai_base_url = "$OPENAI_BASE_URL"\n'
OPENAI_ENV = 'CODEX_API_KEY="$OPENAI_API_KEY"'


def codex_command(codex: str, prompt: str = CODEX_PROMPT, extra: str = "",
                  provider: str = GATEWAY_PROVIDER, env: str = "") -> list[str]:
    """One attempt: Codex with ``provider`` (TOML: its top-level keys, then its tables), in its own home;
    ``extra``: more top-level keys; ``env``: more of its environment (``NAME="value" ...``)."""
    config = (extra + 'model = "gpt-5-codex"\ncheck_for_update_on_startup = false\n' + provider +
              '[analytics]\nenabled = false\n[feedback]\nenabled = false\n')
    home = '"$AGENTRL_WORKDIR/../home"'
    run = " ".join(shlex.quote(a) for a in [codex, "exec", "--skip-git-repo-check", "--ephemeral", "--json", "-s",
                                             "danger-full-access"])
    config = config.replace('"', '\\"')  # inside the shell's double quotes ($OPENAI_BASE_URL expands)
    return ["sh", "-c", f'mkdir -p {home}/.codex && printf "{config}" > {home}/.codex/config.toml && '
                        f'{env} HOME={home} CODEX_HOME={home}/.codex TERM=dumb {run} -C "$AGENTRL_WORKDIR" '
                        f'{shlex.quote(prompt)}']


async def run_group(base: str, out: Any, size: int, reward_cmd: str, command: list[str], *,
                    timeout_s: int = 180) -> tuple[int, list[dict[str, Any]], dict[str, Any]]:
    """``agentrl group`` over ``command`` against the gateway at ``base``, one attempt at a time: its exit status,
    one line a finished attempt and the closing summary (read from pytest's ``capsys``, given as ``out``)."""
    from agentrl.cli import build_parser
    from agentrl.group import GroupRun, check

    args = build_parser().parse_args([
        "group", "--gateway", base, "--admin-key", ADMIN, "--size", str(size), "--parallel", "1", "--keep",
        "--timeout-s", str(timeout_s), "--reward-cmd", reward_cmd, "--", *command])
    status = await GroupRun(args, check(args)).run()
    lines = out.readouterr().out.strip().splitlines()
    return status, [json.loads(line) for line in lines[:-1]], json.loads(lines[-1])


def attempt_logs(summary: dict[str, Any]) -> list[str]:
    """The end of every log of a group's attempts (for an assertion's message)."""
    return [p.read_text()[-3000:] for p in Path(summary["attempts_dir"]).rglob("*.log")]


async def assert_one_compaction(store: Any, session_id: str) -> None:
    """One episode across one compaction: a single summarizer turn, and the window after the summary
    ``compacted_from`` the first one, confirmed, starting from that summarizer's turn."""
    from gateway.episodes import table

    turns = await store.session_interactions(session_id=session_id)
    rows = await table.session_threads(store, session_id)
    summarizers = [t for t in turns if t.request["episode"]["role"] == "summarizer"]
    assert len(summarizers) == 1, [t.request["episode"] for t in turns]
    assert sorted((r.kind, r.edge or "", r.status) for r in rows) == \
        [("main", "", "root"), ("main", "compacted_from", "confirmed")], rows
    (window,) = [r for r in rows if r.edge == "compacted_from"]
    assert window.from_turn == summarizers[0].id


async def clis_or_skip() -> dict[str, str]:
    """The installed CLIs' paths (``claude``, ``codex``); the test is skipped, saying why, where npm could not
    install them."""
    clis, why = await asyncio.to_thread(installed_clis)
    if clis is None:
        pytest.skip(f"the real CLIs are not available: {why}")
    return clis


def standin_of(tiny_model_dir: Path, tok: Any) -> Callable[[str], Any]:
    """Makes a stand-in engine that always answers ``reply`` (the scripted replies of ``ByPrompt``)."""
    def make(reply: str) -> Any:
        return build_app(str(tiny_model_dir), [reply], tokenizer=tok, context_length=CONTEXT)
    return make
