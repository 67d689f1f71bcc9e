"""``agentrl group``: four attempts of one task by an agent command, one GRPO group, rewarded by a check.

The agent is a real process using the ``openai`` SDK, configured only by the environment the command gives
each attempt (``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``, bound to its own session); it writes the model's
answer to a file, and the check (``--reward-cmd``) prints 1 when the file holds 4. The gateway runs
in-process on a real socket over the scripted stand-in engine, which answers "4", "5", "4", "5" in turn
(attempts one at a time, so each answer goes to one attempt).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentrl.cli import build_parser
from agentrl.group import GroupRun, check, reward_of
from agentrl.trajectory import decode_batch
from tests.gateway.episodes.conftest import ADMIN, episode_gw, tokenizer  # noqa: F401 (fixtures)
from tests.inprocess import serve

AGENT = """
import os, pathlib
from openai import OpenAI
client = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY come from agentrl group
reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "What is 2 + 2?"}],
                                       max_tokens=8)
pathlib.Path("answer.txt").write_text(reply.choices[0].message.content or "")
print("attempt", os.environ["AGENTRL_ATTEMPT"], "session", os.environ["AGENTRL_SESSION_ID"])
"""


def test_reward_of_a_check() -> None:
    assert reward_of("3 passed\n0.75\n", 1) == 0.75
    assert reward_of("ok\n", 0) == 1.0 and reward_of("failed\n", 2) == 0.0
    assert reward_of("nan\n", 0) == 1.0 and reward_of("", 1) == 0.0


def test_bad_invocations_say_how_to_fix_them(tmp_path: Path) -> None:
    parser = build_parser()
    for argv, message in ((["group", "--admin-key", "k"], "give the CLI command after --"),
                          (["group", "--admin-key", "k", "--size", "0", "--", "x"], "--size must be at least 1"),
                          (["group", "--", "x"], "--admin-key"),
                          (["group", "--admin-key", "k", "--workdir", str(tmp_path / "no"), "--", "x"], "not a directory")):
        with pytest.raises(SystemExit, match=message):
            check(parser.parse_args(argv))
    assert check(parser.parse_args(["group", "--admin-key", "k", "--", "claude", "-p", "hi"])) == ["claude", "-p", "hi"]


async def test_four_attempts_rewarded_by_a_check_train_as_one_group(episode_gw: Any, tmp_path: Path,  # noqa: F811
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    task = tmp_path / "task"
    task.mkdir()
    (task / "agent.py").write_text(AGENT)
    async with episode_gw(["4", "5", "4", "5"]) as gw:
        async with serve(gw.app) as base:
            args: argparse.Namespace = build_parser().parse_args([
                "group", "--gateway", base, "--admin-key", ADMIN, "--size", "4", "--parallel", "1",
                "--workdir", str(task), "--task-id", "two-plus-two",
                "--reward-cmd", "grep -q 4 answer.txt && echo 1 || echo 0", "--", sys.executable, "agent.py"])
            assert await GroupRun(args, check(args)).run() == 0
            lines = capsys.readouterr().out.strip().splitlines()
            summary = json.loads(lines[-1])
            assert sorted(summary["rewards"]) == [0.0, 0.0, 1.0, 1.0]
            # finished as a whole: leased at once, four rows of four sessions, complete
            async with httpx.AsyncClient(base_url=base, timeout=60) as http:
                resp = await http.get("/v1/trajectories", params={"max_groups": 1, "wait_s": 30},
                                      headers={"Authorization": f"Bearer {ADMIN}"})
        assert resp.status_code == 200, resp.text
        rows, meta = decode_batch(resp.content)
        assert meta["groups"][0]["group_id"] == summary["group_id"] and meta["groups"][0]["complete"] is True
        assert len({r.session_id for r in rows}) == 4 and sorted(r.reward for r in rows) == [0.0, 0.0, 1.0, 1.0]
        assert {r.task_id for r in rows} == {"two-plus-two"}
