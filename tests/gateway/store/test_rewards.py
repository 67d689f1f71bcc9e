"""Rewards: a later value replaces the earlier one, the audit keeps every value."""

from __future__ import annotations

import math

import pytest

from gateway.store import Conflict, InvalidValue, NotFound, Store
from tests.gateway.store.helpers import make_turn


async def test_reward_replace_and_audit(store: Store) -> None:
    s = await store.create_session()
    await store.record_interactions([make_turn("w1", s.id, None, prompt=[1], output=[2])])
    first = await store.set_reward(interaction_id="w1", reward=0.25, source="grader")
    second = await store.set_reward(interaction_id="w1", reward=1, source="human")
    assert (await store.get_interaction(interaction_id="w1")).reward == 1.0
    assert second.id > first.id and second.session_id == s.id and second.interaction_id == "w1"

    on_session = await store.set_reward(session_id=s.id, reward=-0.5, source="env")
    assert on_session.interaction_id is None
    record = await store.get_session(session_id=s.id)
    # every reward, on a turn or on the session, moves the session's version (export claims at the version read)
    assert record.reward == -0.5 and record.version == 3
    assert s.api_key is not None and (await store.get_session_by_key(api_key=s.api_key)).reward == -0.5

    history = await store.reward_history(session_id=s.id)
    assert [(h.interaction_id, h.reward, h.source) for h in history] == [
        ("w1", 0.25, "grader"), ("w1", 1.0, "human"), (None, -0.5, "env")]
    assert [h.reward for h in await store.reward_history(interaction_id="w1")] == [0.25, 1.0]


async def test_reward_errors(store: Store) -> None:
    s = await store.create_session()
    await store.record_interactions([make_turn("e1", s.id, None, prompt=[1], output=[2])])
    for bad in (math.nan, math.inf, "1.0", True, None):
        with pytest.raises(InvalidValue):
            await store.set_reward(interaction_id="e1", reward=bad, source="x")  # type: ignore[arg-type]
    with pytest.raises(InvalidValue):
        await store.set_reward(interaction_id="e1", session_id=s.id, reward=1.0, source="x")
    with pytest.raises(InvalidValue):
        await store.set_reward(reward=1.0, source="x")
    with pytest.raises(NotFound):
        await store.set_reward(interaction_id="missing", reward=1.0, source="x")
    with pytest.raises(NotFound):
        await store.set_reward(session_id="missing", reward=1.0, source="x")

    await store.finish_session(session_id=s.id)
    await store.set_reward(interaction_id="e1", reward=0.5, source="late grader")  # finished: still accepted
    await store.set_session_status(session_id=s.id, status="consumed")
    with pytest.raises(Conflict):
        await store.set_reward(interaction_id="e1", reward=1.0, source="x")
    with pytest.raises(Conflict):
        await store.set_reward(session_id=s.id, reward=1.0, source="x")
    assert (await store.get_interaction(interaction_id="e1")).reward == 0.5
    assert len(await store.reward_history(session_id=s.id)) == 1
