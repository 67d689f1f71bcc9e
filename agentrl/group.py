"""`agentrl group`: N attempts of one task with a coding CLI, trained as one GRPO group.

    agentrl group --size 4 --reward-cmd "pytest -q" --workdir ./task -- claude -p "Fix the failing test"

GRPO learns from the spread of rewards among attempts at the same task. A CLI run is one attempt (one
episode, whatever sub-agents and compactions it makes: ``docs/coding-agents.md``), so this command:

1. admits a group of ``--size`` sessions at once (``POST /v1/groups``; a 429 from the staleness budget is
   waited out as its ``Retry-After`` says);
2. runs the command once per session (``--parallel`` at a time), each in its own copy of ``--workdir`` (an
   empty directory if none is given) and with its own bound URL and key in the environment:
   ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` (OpenAI SDKs, Codex with a provider reading them),
   ``ANTHROPIC_BASE_URL`` / ``ANTHROPIC_API_KEY`` (Claude Code), and ``AGENTRL_BASE_URL``,
   ``AGENTRL_API_KEY``, ``AGENTRL_SESSION_ID``, ``AGENTRL_ATTEMPT``, ``AGENTRL_WORKDIR``; the URL is the
   session's own (``/sessions/{id}``), so every request of the attempt, sub-agents included, is recorded
   in its session whatever key the CLI sends;
3. rewards each attempt by ``--reward-cmd`` (a shell command run in the attempt's directory after the CLI
   ends, with ``AGENTRL_EXIT_CODE`` set): the last line of its output if that is a number, else 1 when it
   exits 0 and 0 otherwise; ``--reward-cmd`` left out: the CLI's own exit status the same way;
4. posts each reward and finishes each session: the group is complete and goes to training at once.

It prints one JSON line per attempt and a last line with the group; its exit status is 0 when every
attempt was rewarded (whatever the rewards), 1 otherwise. An attempt that cannot be rewarded (the CLI
could not start, a timeout) is abandoned, so the rest of the group still trains.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx


@dataclass
class Attempt:
    index: int
    session_id: str
    api_key: str
    workdir: str
    exit_code: int | None = None
    reward: float | None = None
    error: str | None = None
    seconds: float = 0.0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "group", help="run a coding CLI N times on one task as one GRPO group, rewarded by your check",
        description="Run a coding CLI (or any agent command) once per session of a new GRPO group, each with "
                    "its own bound base URL and key in the environment, reward each attempt by your check, and "
                    "finish the group so that it trains at once. See docs/coding-agents.md.",
        usage="agentrl group --size N [--reward-cmd CMD] [--workdir DIR] -- COMMAND [ARG ...]")
    parser.add_argument("--gateway", default=os.environ.get("AGENTRL_GATEWAY_URL", "http://127.0.0.1:8000"),
                        help="the gateway's URL (env AGENTRL_GATEWAY_URL)")
    parser.add_argument("--admin-key", default=os.environ.get("AGENTRL_ADMIN_KEY"),
                        help="an admin or runner key of the gateway (env AGENTRL_ADMIN_KEY)")
    parser.add_argument("--size", type=int, default=4, help="attempts in the group (default 4)")
    parser.add_argument("--parallel", type=int, default=0, help="attempts at a time (default: all)")
    parser.add_argument("--reward-cmd", default=None,
                        help="shell command run in each attempt's directory: a number on its last output line "
                             "is the reward, else exit status 0 -> 1.0, other -> 0.0")
    parser.add_argument("--workdir", default=None, help="a directory copied for each attempt (default: empty)")
    parser.add_argument("--task-id", default=None, help="task id recorded with the group")
    parser.add_argument("--group-id", default=None, help="the group's id (default: a new one)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per attempt (default 1800)")
    parser.add_argument("--keep", action="store_true", help="keep the attempts' directories")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the CLI command, after --")
    parser.set_defaults(func=run)


def check(args: argparse.Namespace) -> list[str]:
    """The command after ``--``; SystemExit with a message saying how to fix a bad invocation."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    problems = []
    if not command:
        problems.append("give the CLI command after --, e.g. agentrl group --size 4 -- claude -p 'task'")
    if args.size < 1:
        problems.append(f"--size must be at least 1, got {args.size}")
    if not args.admin_key:
        problems.append("--admin-key (or AGENTRL_ADMIN_KEY) is needed to create the group")
    if args.workdir is not None and not Path(args.workdir).is_dir():
        problems.append(f"--workdir {args.workdir!r} is not a directory")
    if problems:
        raise SystemExit("agentrl group: " + "; ".join(problems))
    return command


def reward_of(output: str, exit_code: int) -> float:
    """The reward a check reports: the number on its last non-empty output line, else 1/0 by exit status."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if lines:
        try:
            value = float(lines[-1])
        except ValueError:
            value = math.nan
        if math.isfinite(value):
            return value
    return 1.0 if exit_code == 0 else 0.0


def attempt_env(base: str, attempt: Attempt) -> dict[str, str]:
    """The attempt's environment: the caller's, plus its own bound URLs and key."""
    bound = f"{base}/sessions/{attempt.session_id}"
    return {**os.environ,
            "OPENAI_BASE_URL": bound + "/v1", "OPENAI_API_KEY": attempt.api_key,
            "ANTHROPIC_BASE_URL": bound, "ANTHROPIC_API_KEY": attempt.api_key,
            "AGENTRL_BASE_URL": bound, "AGENTRL_API_KEY": attempt.api_key,
            "AGENTRL_SESSION_ID": attempt.session_id, "AGENTRL_ATTEMPT": str(attempt.index),
            "AGENTRL_WORKDIR": attempt.workdir}


async def _run(argv: list[str] | str, cwd: str, env: dict[str, str], timeout_s: float, log: Path) -> tuple[int, str]:
    """Run a command (a list: as is; a string: by the shell), its output to ``log``; (exit code, output)."""
    with log.open("wb") as out:
        if isinstance(argv, str):
            proc = await asyncio.create_subprocess_shell(argv, cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE,
                                                         stderr=asyncio.subprocess.STDOUT,
                                                         stdin=asyncio.subprocess.DEVNULL)
        else:
            proc = await asyncio.create_subprocess_exec(*argv, cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.STDOUT,
                                                        stdin=asyncio.subprocess.DEVNULL)
        try:
            data, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        out.write(data)
    return int(proc.returncode or 0), data.decode(errors="replace")


class GroupRun:
    def __init__(self, args: argparse.Namespace, command: list[str]) -> None:
        self.args, self.command = args, command
        self.base = args.gateway.rstrip("/")
        self.admin = {"Authorization": f"Bearer {args.admin_key}"}

    async def create(self, http: httpx.AsyncClient) -> dict[str, Any]:
        body = {"size": self.args.size, "task_id": self.args.task_id, "group_id": self.args.group_id,
                "metadata": {"command": self.command[:1], "by": "agentrl group"}}
        while True:
            resp = await http.post(f"{self.base}/v1/groups", json={k: v for k, v in body.items() if v is not None},
                                   headers=self.admin)
            if resp.status_code != 429:
                break
            wait = float(resp.headers.get("retry-after") or 1.0)
            print(f"agentrl group: the gateway's staleness budget is full; retrying in {wait:g} s", file=sys.stderr)
            await asyncio.sleep(wait)
        if resp.status_code != 200:
            raise SystemExit(f"agentrl group: POST /v1/groups answered {resp.status_code}: {resp.text[:500]}")
        return resp.json()  # type: ignore[no-any-return]

    async def attempt(self, http: httpx.AsyncClient, attempt: Attempt, gate: asyncio.Semaphore) -> None:
        async with gate:
            started = time.monotonic()
            env = attempt_env(self.base, attempt)
            logs = Path(attempt.workdir).parent
            try:
                attempt.exit_code, output = await _run(self.command, attempt.workdir, env, self.args.timeout_s,
                                                       logs / f"attempt-{attempt.index}.log")
                if self.args.reward_cmd:
                    code, output = await _run(self.args.reward_cmd, attempt.workdir,
                                              {**env, "AGENTRL_EXIT_CODE": str(attempt.exit_code)},
                                              self.args.timeout_s, logs / f"attempt-{attempt.index}.reward.log")
                    attempt.reward = reward_of(output, code)
                else:
                    attempt.reward = 1.0 if attempt.exit_code == 0 else 0.0
            except (OSError, TimeoutError) as exc:
                attempt.error = f"{type(exc).__name__}: {exc}"
            attempt.seconds = round(time.monotonic() - started, 3)
            await self.settle(http, attempt)
            print(json.dumps(asdict(attempt) | {"api_key": None}), flush=True)

    async def settle(self, http: httpx.AsyncClient, attempt: Attempt) -> None:
        """Reward and finish the attempt's session (or abandon it, when there is no reward)."""
        sid = attempt.session_id
        if attempt.reward is None:
            await http.post(f"{self.base}/v1/sessions/{sid}/abandon", headers=self.admin)
            return
        resp = await http.post(f"{self.base}/reward", json={"session_id": sid, "reward": attempt.reward},
                               headers=self.admin)
        if resp.status_code != 200:
            attempt.error = f"POST /reward answered {resp.status_code}: {resp.text[:300]}"
        resp = await http.post(f"{self.base}/v1/sessions/{sid}/finish", headers=self.admin)
        if resp.status_code != 200 and attempt.error is None:
            attempt.error = f"finish answered {resp.status_code}: {resp.text[:300]}"

    async def run(self) -> int:
        root = Path(tempfile.mkdtemp(prefix="agentrl-group-"))
        try:
            async with httpx.AsyncClient(timeout=60) as http:
                group = await self.create(http)
                attempts = []
                for index, s in enumerate(group["sessions"]):
                    workdir = root / f"attempt-{index}" / "work"
                    if self.args.workdir is not None:
                        shutil.copytree(self.args.workdir, workdir, symlinks=True)
                    else:
                        workdir.mkdir(parents=True)
                    attempts.append(Attempt(index, s["session_id"], s["api_key"], str(workdir)))
                gate = asyncio.Semaphore(self.args.parallel or len(attempts))
                await asyncio.gather(*(self.attempt(http, a, gate) for a in attempts))
                status = (await http.get(f"{self.base}/v1/groups/{group['group_id']}", headers=self.admin)).json()
            rewards = [a.reward for a in attempts]
            print(json.dumps({"group_id": group["group_id"], "rewards": rewards, "status": status.get("status"),
                              "attempts_dir": str(root) if self.args.keep else None}), flush=True)
            return 0 if all(a.reward is not None and a.error is None for a in attempts) else 1
        finally:
            if not self.args.keep:
                shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    command = check(args)
    return asyncio.run(GroupRun(args, command).run())
