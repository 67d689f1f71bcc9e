"""The agents and the runner against the REAL gateway and embedded engine (tiny random model).

With random weights the model's answers are wrong, so the 2-turn correction path is the natural case. For
"a correct first answer ends after one turn" the agent is given a scorer that accepts whatever the model
said (`accept_all`): the agent only sees the score, so this exercises exactly the stop-when-correct path.
Deterministic tool calls come from a scripted stand-in engine (`scripted_engine.py`) behind the real gateway.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
from openai import AsyncOpenAI

from agents.datasets import Sample
from agents.episode import GatewayRewards
from agents.math_agent import CORRECTION, SYSTEM_PROMPT, run_math_agent
from agents.rewards import RewardPool
from agents.runner import EpisodeRecord, RunnerSettings, run_agents
from agents.tool_agent import Tool, run_tool_agent
from tests.agents.reward_fns import accept_all

# An answer no random model will produce: math_reward scores every attempt 0.0.
UNREACHABLE = Sample("q-unreachable", "What is 123 * 4567 - 0.125?", "561740.875")


async def accept_all_async(completion: str, reference: str) -> float:
    return 1.0


def tree(gateway, session_id: str) -> dict:
    with gateway.admin() as admin:
        response = admin.get(f"/v1/sessions/{session_id}")
        response.raise_for_status()
        return response.json()


def messages_of(node: dict) -> list[dict]:
    return node["request"]["messages"]


async def run_math(gateway, sample: Sample, **kw):
    session = gateway.create_session(task_id=sample.id, metadata={"test": "agents"})
    async with AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"]) as client:
        episode = await run_math_agent(client, sample, model="tiny", max_tokens=8, temperature=1.0,
                                       rewards=GatewayRewards(gateway.base_url, session["api_key"]), **kw)
    with gateway.admin() as admin:
        admin.post(f"/v1/sessions/{session['session_id']}/finish").raise_for_status()
    return session, episode


async def test_wrong_answer_makes_a_two_turn_path_with_a_correction(gateway):
    session, episode = await run_math(gateway, UNREACHABLE)
    assert [t.reward for t in episode.turns] == [0.0, 0.0] and not episode.correct_final

    recorded = tree(gateway, session["session_id"])
    assert recorded["num_interactions"] == 2 and len(recorded["roots"]) == 1
    root = recorded["roots"][0]
    assert root["id"] == episode.turns[0].response_id and root["reward"] == 0.0
    assert [m["role"] for m in messages_of(root)] == ["system", "user"]
    assert messages_of(root)[0]["content"] == SYSTEM_PROMPT
    # the retry continues the conversation: one child of the first turn, whose new message is the correction
    (child,) = root["children"]
    assert child["id"] == episode.turns[1].response_id and child["parent_id"] == root["id"]
    assert child["reward"] == 0.0
    assert messages_of(child)[-1] == {"role": "user", "content": CORRECTION}
    assert recorded["session"]["status"] in ("finished", "consumed")  # consumed: exported for training already


async def test_correct_first_answer_ends_after_one_turn(gateway):
    session, episode = await run_math(gateway, UNREACHABLE, score=accept_all_async)
    assert len(episode.turns) == 1 and episode.correct_first and episode.correct_final

    recorded = tree(gateway, session["session_id"])
    assert recorded["num_interactions"] == 1
    (root,) = recorded["roots"]
    assert root["id"] == episode.turns[0].response_id and root["reward"] == 1.0 and root["children"] == []


@pytest.mark.slow  # starts its own stand-in engine and gateway: 30-100 s on a loaded 2-core machine
async def test_tool_agent_runs_parallel_tool_calls_and_returns_results(gateway_factory, scripted_engine):
    # Turn 1 asks for three tools at once; turn 2 answers. Token ids come from the real tokenizer.
    calls = [{"name": "calculator", "arguments": {"expression": "12 * 7"}},
             {"name": "rendezvous", "arguments": {"who": "a"}},
             {"name": "rendezvous", "arguments": {"who": "b"}}]
    first = "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)
    engine = scripted_engine([first, "12 * 7 = 84, and 84 + 7 = 91.\n#### 91"])
    gateway = gateway_factory(engine_urls=[engine])

    # Both rendezvous calls must be running at the same time for either to return: proof of parallelism.
    arrived: list[str] = []
    both_here = asyncio.Event()

    async def rendezvous(who: str) -> str:
        arrived.append(who)
        if len(arrived) == 2:
            both_here.set()
        await asyncio.wait_for(both_here.wait(), timeout=10)
        return f"{who} met {len(arrived) - 1} other"

    tool = Tool("rendezvous", "wait for the other caller",
                {"type": "object", "properties": {"who": {"type": "string"}}, "required": ["who"]}, rendezvous)
    session = gateway.create_session(task_id="tools-1")
    async with AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"]) as client:
        episode = await run_tool_agent(client, Sample("tools-1", "What is 12 * 7 + 7?", "91"), model="tiny",
                                       tools=[tool], rewards=GatewayRewards(gateway.base_url, session["api_key"]))

    assert [t.tool_calls for t in episode.turns] == [3, 0]
    assert episode.correct_final and episode.turns[1].reward == 1.0
    assert sorted(arrived) == ["a", "b"]

    recorded = tree(gateway, session["session_id"])
    (root,) = recorded["roots"]
    assert root["finish_reason"] == "tool_calls" and len(root["response_message"]["tool_calls"]) == 3
    (child,) = root["children"]
    tool_messages = [m for m in messages_of(child) if m["role"] == "tool"]
    ids = [c["id"] for c in root["response_message"]["tool_calls"]]
    assert [m["tool_call_id"] for m in tool_messages] == ids
    assert [m["content"] for m in tool_messages] == ["84", "a met 1 other", "b met 1 other"]
    assert child["reward"] == 1.0

    # the model was shown all three results, in order, in its second prompt
    with httpx.Client() as http:
        requests = http.get(engine + "/requests").json()
    assert len(requests) == 2
    from tokenizers import Tokenizer

    from engine.models import tiny_dir

    prompt = Tokenizer.from_file(str(tiny_dir() / "tokenizer.json")).decode(requests[1]["input_ids"],
                                                                           skip_special_tokens=False)
    shown = re.findall(r"<tool_response>\s*(.*?)\s*</tool_response>", prompt, re.S)
    assert shown == ["84", "a met 1 other", "b met 1 other"]


async def test_runner_groups_sessions_posts_rewards_and_finishes(gateway):
    records: list[EpisodeRecord] = []
    settings = RunnerSettings(gateway=gateway.base_url, admin_key=gateway.admin_key, dataset="synthetic:3",
                              limit=2, group_size=2, concurrency=4, max_tokens=8, eval=True, progress=False)
    settings.validate()
    summary = await run_agents(settings, on_episode=records.append)

    assert (summary["prompts"], summary["sessions"], summary["episodes"], summary["failed"]) == (2, 4, 4, 0)
    assert 1.0 <= summary["mean_turns"] <= 2.0
    assert summary["reward_timeouts"] == summary["reward_crashes"] == 0
    assert len({r.group_id for r in records}) == 2
    for record in records:
        recorded = tree(gateway, record.session_id)
        session = recorded["session"]
        assert session["status"] == "finished" and session["group_id"] == record.group_id  # eval: never consumed
        assert session["metadata"]["eval"] is True and session["task_id"] == record.sample.id
        turns = record.episode.turns
        assert recorded["num_interactions"] == len(turns)
        assert recorded["roots"][0]["reward"] == turns[0].reward  # every turn's reward reached the gateway


async def test_runner_with_an_injected_reward_function_stops_after_turn_one(gateway):
    settings = RunnerSettings(gateway=gateway.base_url, admin_key=gateway.admin_key, dataset="synthetic:1",
                              limit=2, group_size=1, concurrency=2, max_tokens=8, progress=False)
    with RewardPool(workers=1) as pool:  # one warm pool for several runs, as `agentrl up` may keep it
        for offset in (0, 2):
            settings.offset = offset
            summary = await run_agents(settings, reward_fn=accept_all, reward_pool=pool)
            assert summary["accuracy_turn1"] == summary["accuracy_final"] == summary["mean_reward"] == 1.0
            assert summary["mean_turns"] == 1.0 and summary["episodes"] == 2
        assert pool.stats.calls == 4


@pytest.mark.parametrize("agent", ["math", "tools"])
def test_cli_prints_the_summary(gateway, capsys, agent):
    import argparse

    from agents.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())  # only `agentrl agent`: the other components' parsers are not needed

    def main(argv: list[str]) -> int:
        args = parser.parse_args(argv)
        return args.func(args)

    code = main(["agent", agent, "--gateway", gateway.base_url, "--admin-key", gateway.admin_key,
                 "--dataset", "synthetic:2", "--limit", "1", "--group-size", "2", "--max-tokens", "8",
                 "--no-progress", "--eval"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["episodes"] == 2 and summary["eval"] is True and summary["failed"] == 0
    assert summary["agent"] == agent and 1.0 <= summary["mean_turns"] <= (2 if agent == "math" else 4)


async def test_runner_abandons_failed_episodes_and_goes_on(gateway):
    """A failed episode abandons its session (never trained on; its place comes back), as agentrl.client
    does for an exception; the others are finished and the run goes on. Two real failures: the gateway's
    400 for a prompt that cannot fit the context, and an exception in the agent's own code path (a reward
    function that is not module-level: `RewardPool.score` raises ValueError inside the episode)."""
    records: list[EpisodeRecord] = []
    settings = RunnerSettings(gateway=gateway.base_url, admin_key=gateway.admin_key, dataset="synthetic:1",
                              group_size=2, concurrency=4, max_tokens=4, eval=True, progress=False)
    settings.validate()
    too_long = Sample("q-too-long", "What is 1 + 1? " * 40_000, "2")
    summary = await run_agents(settings, samples=[too_long, UNREACHABLE], on_episode=records.append)
    assert (summary["sessions"], summary["episodes"], summary["failed"]) == (4, 2, 2)
    status = {r.session_id: tree(gateway, r.session_id)["session"]["status"] for r in records}
    for r in records:
        assert status[r.session_id] == ("abandoned" if r.sample.id == "q-too-long" else "finished"), (r, status)
        assert (r.episode is None) == (r.sample.id == "q-too-long")

    def not_module_level(completion: str, reference: str) -> float:
        return 1.0

    records.clear()
    summary = await run_agents(settings, samples=[UNREACHABLE], reward_fn=not_module_level,
                               on_episode=records.append)
    assert (summary["sessions"], summary["episodes"], summary["failed"]) == (2, 0, 2)
    for r in records:
        recorded = tree(gateway, r.session_id)
        assert recorded["session"]["status"] == "abandoned" and recorded["num_interactions"] == 1


async def test_runner_groups_reach_the_trainer_as_complete_groups(gateway):
    """A non-eval run's G sessions per prompt come out of GET /v1/trajectories as one group of G rows, each
    row the session's whole correction path with the agent's per-turn rewards and response ids."""
    from agentrl.trajectory import decode_batch

    records: list[EpisodeRecord] = []
    settings = RunnerSettings(gateway=gateway.base_url, admin_key=gateway.admin_key, dataset="synthetic:4",
                              limit=1, group_size=2, concurrency=2, max_tokens=6, progress=False)
    settings.validate()
    await run_agents(settings, on_episode=records.append)
    (group_id,) = {r.group_id for r in records}
    headers = {"Authorization": f"Bearer {gateway.admin_key}"}
    mine = []
    async with httpx.AsyncClient(base_url=gateway.base_url, headers=headers, timeout=60) as admin:
        for _ in range(12):  # earlier tests' groups may be queued first: lease, ack, look for ours
            response = await admin.get("/v1/trajectories", params={"max_groups": 100, "wait_s": 5})
            if response.status_code == 204:
                continue
            response.raise_for_status()
            rows, meta = decode_batch(response.content)
            (await admin.post("/v1/trajectories/ack", json={"lease_id": meta["lease_id"]})).raise_for_status()
            mine += [row for row in rows if row.group_id == group_id]
            if mine:
                break
    assert sorted(row.session_id for row in mine) == sorted(r.session_id for r in records)
    for row in mine:
        (record,) = [r for r in records if r.session_id == row.session_id]
        assert row.turn_interaction_ids == [t.response_id for t in record.episode.turns]
        assert list(row.turn_rewards) == [t.reward for t in record.episode.turns]


async def test_runner_backs_off_on_429_until_the_trainer_moves_on(gateway):
    """At the staleness limit the gateway answers 429 + Retry-After; the runner waits, and continues when
    the trainer's version moves on (kept last in the module: it registers a trainer on the shared gateway)."""
    headers = {"Authorization": f"Bearer {gateway.admin_key}"}
    async with httpx.AsyncClient(base_url=gateway.base_url, headers=headers, timeout=60) as admin:

        async def register(version: int, batch_size: int = 1) -> dict:
            response = await admin.post("/admin/trainer", json={"version": version, "batch_size": batch_size,
                                                                "staleness_bound": 0})
            response.raise_for_status()
            return response.json()["trainer"]

        version = 0
        state = await register(version)
        while state["limit"] - state["admitted"] < 1:  # sessions of earlier tests may fill the budget
            version += 1
            state = await register(version)
        free = state["limit"] - state["admitted"]

        done: list[EpisodeRecord] = []
        settings = RunnerSettings(gateway=gateway.base_url, admin_key=gateway.admin_key, dataset="synthetic:1",
                                  limit=free + 1, group_size=1, concurrency=free + 1, max_tokens=4, progress=False)
        settings.validate()
        runner = asyncio.create_task(run_agents(settings, on_episode=done.append))
        try:
            while len(done) < free:  # the budget's sessions run; the last one is refused meanwhile
                assert not runner.done(), runner.exception()
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)
            assert len(done) == free
            await register(version + 1)  # a training step: the budget grows
            summary = await asyncio.wait_for(runner, timeout=120)
        finally:
            runner.cancel()
            await register(0, batch_size=10**6)  # a new registration with room for everything
    assert summary["episodes"] == free + 1 and summary["failed"] == 0
    assert summary["backoffs_429"] >= 1
