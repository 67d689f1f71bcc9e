"""A weight push through the gateway's admin API while a request is in flight.

The gateway pauses the engines (the in-flight generation is aborted and held), the trainer updates the
weights, the gateway resumes with the new version and re-sends the held request as prompt + partial
output. The agent sees one normal reply; the recorded turn carries tokens of both versions, and each
token's logprob is the one of the weights that generated it.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest
import torch

from gateway.store import Store
from tests.engine_hooks import held_decoding, wait_for, wait_held
from tests.trainer.conftest import trainer_logprobs
from trainer.model import load_model
from trainer.weight_sync import DiskSync, GatewayControl, push_weights


async def _turns(db: str, session_id: str):
    store = await Store.open(db, migrate=False)
    try:
        return await store.session_interactions(session_id=session_id)
    finally:
        await store.close()


def long_story(session: dict, max_tokens: int) -> tuple[threading.Thread, dict]:
    """An agent thread asking for a long story in ``session``; its reply lands in ``result["reply"]``."""
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0, timeout=300)
    result: dict = {}

    def agent() -> None:
        result["reply"] = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Tell me a long story."}],
            max_tokens=max_tokens, temperature=1.0, seed=5)

    thread = threading.Thread(target=agent)
    thread.start()
    return thread, result


HELD = 20  # output tokens the engine holds a story at while a push lands (tests/engine_hooks.py)


def perturb(model: torch.nn.Module) -> None:
    """New weights for version 1 (seeded noise)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)


@pytest.mark.slow
def test_request_in_flight_during_a_push_completes_with_tokens_of_both_versions(
        gateway_factory, trainer_engine, tiny_model_dir, dist_info, tmp_path):
    gw = gateway_factory()
    model = load_model(tiny_model_dir)
    session = gw.create_session(group_id="inflight")
    perturb(model)
    http = httpx.Client(timeout=120)
    # the story is held by the engine at HELD tokens (version 0) while the push lands, whatever the machine's
    # speed; after the push the re-sent story is held again at HELD new tokens until the release
    with held_decoding(trainer_engine, HELD):
        thread, result = long_story(session, max_tokens=400)
        wait_held(trainer_engine)
        push_weights(model, 1, info=dist_info, transport=DiskSync(tmp_path / "sync", tiny_model_dir, http),
                     control=GatewayControl(gw.base_url, gw.admin_key, client=http))
    thread.join(timeout=240)
    assert not thread.is_alive()
    reply = result["reply"]
    assert reply.choices[0].finish_reason in ("stop", "length")

    (turn,) = asyncio.run(_turns(gw.db, session["session_id"]))
    versions = list(turn.output_versions)
    assert versions[0] == 0 and versions[-1] == 1, versions
    assert versions == sorted(versions)  # one switch, from 0 to 1
    switch = versions.index(1)
    assert switch == HELD  # the held tokens are version 0, the re-sent segment version 1
    prompt, output = list(turn.prompt_ids), list(turn.output_ids)
    recorded = torch.tensor(turn.output_logprobs)
    new = trainer_logprobs(model, prompt, output)
    old = trainer_logprobs(load_model(tiny_model_dir), prompt, output)  # version 0 = the tiny model's weights
    assert (recorded[:switch] - old[:switch]).abs().max() < 1e-4
    assert (recorded[switch:] - new[switch:]).abs().max() < 1e-4
    with gw.admin() as admin:
        assert admin.get("/admin/weight_version").json()["weight_version"] == 1


@pytest.mark.slow
def test_a_push_without_the_gateway_keeps_the_request_in_the_engine_and_records_both_versions(
        gateway_factory, trainer_engine, tiny_model_dir, dist_info, tmp_path):
    """The trainer pushes straight to the engine (``DirectControl``: ``retract`` pause, update without flush,
    ``/flush_cache``, continue) while the gateway only routes and records: the engine keeps the request
    across the push and re-prefills it under the new weights; the gateway sees one uninterrupted generation
    (one segment) and records each token's version from the engine's ``weight_versions`` spans; export
    counts the row as old as its oldest token."""
    from agentrl.trajectory import export_session, turn_from_interaction
    from trainer.weight_sync import DirectControl

    gw = gateway_factory()
    model = load_model(tiny_model_dir)
    session = gw.create_session(group_id="direct")
    # at seed 5 the tiny model's first 300 tokens hold no EOS, so the story reaches the hold
    perturb(model)
    http = httpx.Client(timeout=120)
    with held_decoding(trainer_engine, HELD):  # running, at HELD tokens of version 0, when the push lands
        thread, result = long_story(session, max_tokens=400)
        wait_held(trainer_engine)
        push_weights(model, 1, info=dist_info, transport=DiskSync(tmp_path / "sync", tiny_model_dir, http),
                     control=DirectControl([trainer_engine], client=http))
    thread.join(timeout=240)
    assert not thread.is_alive() and result["reply"].choices[0].finish_reason in ("stop", "length")

    (turn,) = asyncio.run(_turns(gw.db, session["session_id"]))
    versions = list(turn.output_versions)
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions), versions
    switch = versions.index(1)
    assert switch == HELD  # retracted at HELD tokens, re-prefilled under version 1
    prompt, output = list(turn.prompt_ids), list(turn.output_ids)
    recorded = torch.tensor(turn.output_logprobs)
    old = trainer_logprobs(load_model(tiny_model_dir), prompt, output)
    new = trainer_logprobs(model, prompt, output)  # re-prefilled: a full recompute under the new weights
    assert (recorded[:switch] - old[:switch]).abs().max() < 1e-4
    assert (recorded[switch:] - new[switch:]).abs().max() < 1e-4
    with gw.admin() as admin:  # the gateway did not pause or re-send anything
        assert admin.get("/admin/engines").json()["paused"] is False
    (row,) = export_session([turn_from_interaction(turn)], gamma=1.0, session_reward=1.0)
    assert row.min_version == 0 and list(row.versions[row.loss_mask.astype(bool)]) == versions


@pytest.mark.slow
def test_colocated_step_frees_the_engine_and_a_request_sent_meanwhile_waits_for_the_new_weights(
        gateway_factory, tiny_model_dir, dist_info):
    """--release-memory: the gateway pauses, the engine frees its KV cache and weights for the step; an agent's
    request sent during the step is held by the gateway (not refused), then served by the pushed weights."""
    from trainer.weight_sync import TensorSync, engines_released

    gw = gateway_factory()
    model = load_model(tiny_model_dir)
    session = gw.create_session(group_id="colocated")
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0, timeout=300)
    http = httpx.Client(timeout=120)
    control = GatewayControl(gw.base_url, gw.admin_key, client=http)
    result: dict = {}

    def agent() -> None:
        result["reply"] = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=1.0)

    with engines_released(["kv_cache", "weights"], 0, info=dist_info, control=control, client=http) as timings:
        (engine,) = control.engines()
        state = http.get(f"{engine}/get_server_info").json()["internal_states"][0]
        assert state["memory_released"] == ["kv_cache", "weights"]
        thread = threading.Thread(target=agent)
        thread.start()
        with gw.admin() as admin:  # the request reached the gateway and is held there, not refused
            wait_for(lambda: admin.get("/admin/engines").json()["held"] == 1, "the gateway to hold the request")
        assert "reply" not in result
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    assert timings["engine/release_s"] > 0 and timings["engine/resume_memory_s"] > 0
    push_weights(model, 1, info=dist_info, transport=TensorSync(client=http), control=control)
    thread.join(timeout=240)
    assert not thread.is_alive() and result["reply"].choices[0].finish_reason in ("stop", "length")
    (turn,) = asyncio.run(_turns(gw.db, session["session_id"]))
    assert set(turn.output_versions) == {1}
    recorded = torch.tensor(turn.output_logprobs)
    new = trainer_logprobs(model, list(turn.prompt_ids), list(turn.output_ids))
    assert (recorded - new).abs().max() < 1e-4
