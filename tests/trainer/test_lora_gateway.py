"""An adapter push through the gateway while a story is in flight, on an engine serving the trained adapter by
default (``--default-lora policy``: today's gateway names no adapter in its requests).

Same story as a full push (test_gateway_push.py): the gateway pauses (the story is aborted and held), the
trainer unloads the old adapter, loads the new one and moves the engine's version, the gateway resumes and
re-sends the story; its tokens before the push are version 0 with the first adapter's logprobs, after it
version 1 with the trainer's new adapter's logprobs.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from agentrl.procs import Processes
from tests.engine_hooks import held_decoding, wait_held
from tests.trainer.conftest import start_engine, trainer_logprobs
from tests.trainer.test_gateway_push import HELD, _turns, long_story
from trainer import lora
from trainer.lora_push import AdapterSync, push_adapter
from trainer.model import load_model
from trainer.weight_sync import GatewayControl


@pytest.fixture(scope="module")
def lora_engine(tmp_path_factory) -> str:
    with Processes(tmp_path_factory.mktemp("lora-engine")) as procs:
        yield start_engine(procs, "--default-lora", "policy")


@pytest.fixture
def engine_url(lora_engine: str) -> str:
    """Gateways of this module serve the engine with the default adapter."""
    return lora_engine


@pytest.mark.slow
def test_an_adapter_push_during_a_story_gives_tokens_of_both_versions(gateway_factory, lora_engine, tiny_model_dir,
                                                                       dist_info, tmp_path):
    gw = gateway_factory()
    http = httpx.Client(timeout=120)
    control = GatewayControl(gw.base_url, gw.admin_key, client=http)
    transport = AdapterSync("policy", "disk", tmp_path / "sync", http)
    model = load_model(tiny_model_dir, lora=lora.LoraSpec(4, 8.0))
    push_adapter(model, 0, info=dist_info, transport=transport, control=control)  # what the trainer does at start
    served = [m["id"] for m in httpx.get(lora_engine + "/v1/models").json()["data"][1:]]
    assert served == ["policy"]
    v0 = load_model(tiny_model_dir, lora=lora.LoraSpec(4, 8.0))  # a copy of version 0 (B = 0: the base)
    torch.manual_seed(0)
    with torch.no_grad():  # version 1: a trained adapter stands in as seeded noise on A and B
        for name, p in model.named_parameters():
            if lora.is_adapter_name(name):
                p.add_(torch.randn_like(p) * 0.2)

    session = gw.create_session(group_id="lora-inflight")
    with held_decoding(lora_engine, HELD):  # held at HELD tokens of version 0 while the push lands
        thread, result = long_story(session, max_tokens=400)
        wait_held(lora_engine)
        pushed = push_adapter(model, 1, info=dist_info, transport=transport, control=control)
    thread.join(timeout=240)
    assert not thread.is_alive() and result["reply"].choices[0].finish_reason in ("stop", "length")
    assert pushed.bytes == lora.adapter_bytes(model)

    (turn,) = asyncio.run(_turns(gw.db, session["session_id"]))
    versions = list(turn.output_versions)
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions), versions
    switch = versions.index(1)
    assert switch == HELD
    prompt, output = list(turn.prompt_ids), list(turn.output_ids)
    recorded = torch.tensor(turn.output_logprobs)
    model.eval()
    v0.eval()
    assert (recorded[:switch] - trainer_logprobs(v0, prompt, output)[:switch]).abs().max() < 1e-4
    assert (recorded[switch:] - trainer_logprobs(model, prompt, output)[switch:]).abs().max() < 1e-4
    with gw.admin() as admin:
        assert admin.get("/admin/weight_version").json()["weight_version"] == 1
