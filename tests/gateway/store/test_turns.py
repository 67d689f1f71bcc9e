"""Turn trees: recording, parent lookup by chain hash, full sequences, linear storage."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from gateway.store import Conflict, InvalidValue, NotFound, Store
from gateway.store import schema
from tests.gateway.store.helpers import make_turn


async def _three_turns_and_branch(store: Store) -> str:
    s = await store.create_session()
    await store.record_interactions([make_turn("t1", s.id, None, prompt=[1, 2, 3], output=[10, 11])])
    await store.record_interactions([make_turn("t2", s.id, "t1", prompt=[20, 21], output=[30], version=1)])
    await store.record_interactions([make_turn("t3", s.id, "t2", prompt=[40], output=[50, 51, 52], version=2)])
    # a branch off t1 (the agent rewrote its second message)
    await store.record_interactions([make_turn("b2", s.id, "t1", prompt=[60, 61, 62], output=[70])])
    return s.id


async def test_tree_roundtrip(store: Store) -> None:
    sid = await _three_turns_and_branch(store)
    t3 = await store.get_interaction(interaction_id="t3")
    assert (t3.parent_id, t3.prompt_ids, t3.output_ids, t3.output_versions) == ("t2", [40], [50, 51, 52], [2, 2, 2])
    assert t3.output_logprobs == [-0.5, -1.0, -1.5]  # exact in float32
    assert t3.response_message == {"role": "assistant", "content": "answer t3", "tool_calls": None}
    assert t3.timings == {"engine_ms": 1.5}

    turns = await store.session_interactions(session_id=sid)
    assert [t.id for t in turns] == ["t1", "t2", "t3", "b2"]
    tree = await store.session_tree_json(session_id=sid, decode=lambda ids: " ".join(map(str, ids)))
    assert tree["num_interactions"] == 4 and [r["id"] for r in tree["roots"]] == ["t1"]
    root = tree["roots"][0]
    assert [c["id"] for c in root["children"]] == ["t2", "b2"]
    assert root["children"][0]["children"][0]["id"] == "t3"
    assert root["prompt_tokens"] == 3 and root["output_text"] == "10 11" and root["root_reason"] == "first_turn"
    assert root["children"][0]["versions"] == [1, 1]
    assert "api_key" not in tree["session"]

    with pytest.raises(NotFound):
        await store.get_interaction(interaction_id="missing")
    with pytest.raises(NotFound):
        await store.session_interactions(session_id="missing")


async def test_full_sequence(store: Store, backend) -> None:
    await _three_turns_and_branch(store)
    expect = {
        "t1": [1, 2, 3, 10, 11],
        "t2": [1, 2, 3, 10, 11, 20, 21, 30],
        "t3": [1, 2, 3, 10, 11, 20, 21, 30, 40, 50, 51, 52],
        "b2": [1, 2, 3, 10, 11, 60, 61, 62, 70],
    }
    for turn_id, tokens in expect.items():
        assert await store.full_sequence(interaction_id=turn_id) == tokens
    # a second store has cold in-process caches: the same sequences come from Redis or from SQL
    other = await backend.open()
    try:
        for turn_id, tokens in expect.items():
            assert await other.full_sequence(interaction_id=turn_id) == tokens
        with pytest.raises(NotFound):
            await other.full_sequence(interaction_id="missing")
    finally:
        await other.close()


async def test_find_parent_longest_prefix_and_most_recent(store: Store) -> None:
    sid = await _three_turns_and_branch(store)
    match = await store.find_parent(session_id=sid, candidates=[(6, "chain-t3"), (4, "chain-t2"), (2, "chain-t1")])
    assert match is not None and (match.prefix_len, match.interaction.id) == (6, "t3")
    match = await store.find_parent(session_id=sid, candidates=[(6, "nope"), (4, "chain-t2"), (2, "chain-t1")])
    assert match is not None and (match.prefix_len, match.interaction.id) == (4, "t2")
    assert await store.find_parent(session_id=sid, candidates=[(2, "nope")]) is None
    assert await store.find_parent(session_id=sid, candidates=[]) is None
    other = await store.create_session()  # hashes are per session
    assert await store.find_parent(session_id=other.id, candidates=[(2, "chain-t1")]) is None

    # a retry of t2's request: same chain hash, recorded later -> the most recent wins
    t1 = await store.get_interaction(interaction_id="t1")
    retry = make_turn("t2-retry", sid, "t1", prompt=[20, 21], output=[31], chain_hash="chain-t2",
                      request_hash="req-t2", created_at=t1.created_at + 1e6)
    await store.record_interactions([retry])
    match = await store.find_parent(session_id=sid, candidates=[(4, "chain-t2")])
    assert match is not None and match.interaction.id == "t2-retry"


async def test_storage_is_linear(store: Store) -> None:
    """Each turn stores only its prompt delta: bytes grow linearly with conversation length."""
    s = await store.create_session()
    parent = None
    delta, out, turns = 50, 20, 12
    for k in range(turns):
        turn = make_turn(f"lin{k}", s.id, parent, prompt=list(range(delta)), output=list(range(out)))
        await store.record_interactions([turn])
        parent = turn.id
    i = schema.interactions
    async with store.engine.connect() as conn:
        sizes = (await conn.execute(
            sa.select(sa.func.length(i.c.prompt_ids), sa.func.length(i.c.output_ids)).where(i.c.session_id == s.id)
        )).all()
    assert sizes == [(4 * delta, 4 * out)] * turns  # packed int32, deltas only
    assert len(await store.full_sequence(interaction_id=parent)) == turns * (delta + out)


async def test_rejected_turns(store: Store) -> None:
    s = await store.create_session()
    await store.record_interactions([make_turn("r1", s.id, None, prompt=[1], output=[2])])
    with pytest.raises(Conflict):  # duplicate id
        await store.record_interactions([make_turn("r1", s.id, None, prompt=[1], output=[2])])
    with pytest.raises(NotFound):
        await store.record_interactions([make_turn("r2", s.id, "ghost", prompt=[1], output=[2])])
    with pytest.raises(NotFound):
        await store.record_interactions([make_turn("r3", "sess-ghost", None, prompt=[1], output=[2])])
    other = await store.create_session()
    with pytest.raises(Conflict):  # parent from another session
        await store.record_interactions([make_turn("r4", other.id, "r1", prompt=[1], output=[2])])
    bad = make_turn("r5", s.id, "r1", prompt=[1], output=[2, 3])
    bad.output_logprobs = [-1.0]
    with pytest.raises(InvalidValue):
        await store.record_interactions([bad])
    with pytest.raises(InvalidValue):
        await store.record_interactions([make_turn("r6", s.id, "r1", prompt=[2**40], output=[2])])
    await store.finish_session(session_id=s.id)
    with pytest.raises(Conflict):  # a finished session takes no more turns
        await store.record_interactions([make_turn("r7", s.id, "r1", prompt=[1], output=[2])])
    assert [t.id for t in await store.session_interactions(session_id=s.id)] == ["r1"]
    assert await store.session_interactions(session_id=other.id) == []


async def test_siblings_in_one_call_and_root_reasons(store: Store) -> None:
    s = await store.create_session()
    root = make_turn("n0", s.id, None, prompt=[1, 2], output=[3])
    # n=3: three sibling choices of one request, recorded by one call together with nothing else
    await store.record_interactions([root])
    siblings = [make_turn(f"n1-{k}", s.id, "n0", prompt=[4], output=[5 + k], request_hash="same") for k in range(3)]
    await store.record_interactions(siblings)
    drift = make_turn("n-drift", s.id, None, prompt=[9], output=[9])
    drift.root_reason = "no_prefix_match"
    await store.record_interactions([drift])
    turns = await store.session_interactions(session_id=s.id)
    assert sorted(t.id for t in turns if t.parent_id == "n0") == ["n1-0", "n1-1", "n1-2"]
    assert sorted(t.root_reason for t in turns if t.parent_id is None) == ["first_turn", "no_prefix_match"]
    last = (await store.get_session(session_id=s.id)).last_activity_at
    assert last >= drift.created_at


async def test_find_session_by_chain_for_implicit_episodes(store: Store) -> None:
    implicit = await store.create_session(group_id="grp-root", metadata={"implicit": True})
    explicit = await store.create_session()
    await store.record_interactions([make_turn("i0", implicit.id, None, prompt=[1], output=[2], chain_hash="h-a")])
    await store.record_interactions([make_turn("i1", implicit.id, "i0", prompt=[3], output=[4], chain_hash="h-b")])
    await store.record_interactions([make_turn("e0", explicit.id, None, prompt=[1], output=[2], chain_hash="h-c")])
    found = await store.find_session_by_chain(chain_hashes=["h-x", "h-b", "h-a"])
    assert found is not None and found.id == implicit.id and found.group_id == "grp-root"
    assert await store.find_session_by_chain(chain_hashes=["h-c"]) is None  # explicit sessions stay private
    found = await store.find_session_by_chain(chain_hashes=["h-c"], implicit_only=False)
    assert found is not None and found.id == explicit.id
    assert await store.find_session_by_chain(chain_hashes=[]) is None


async def test_path_is_the_root_to_turn_chain(store: Store) -> None:
    await _three_turns_and_branch(store)
    assert [t.id for t in await store.path(interaction_id="t3")] == ["t1", "t2", "t3"]
    assert [t.id for t in await store.path(interaction_id="b2")] == ["t1", "b2"]
    (root,) = await store.path(interaction_id="t1")
    assert root.prompt_ids == [1, 2, 3] and root.response_message["content"] == "answer t1"
    with pytest.raises(NotFound):
        await store.path(interaction_id="nope")
