"""Remote compaction v2 through the real ``openai`` SDK (not streamed; the streamed form is in the replay of
capture B1c): the trigger is answered with exactly one ``compaction`` item, which the next request expands
into the summary; items this gateway did not mint and a trigger that is not last are 400s."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from gateway.episodes import compaction
from tests.gateway.episodes.conftest import AGENT

TASK = [{"type": "message", "role": "user", "content": "Make three files."}]


async def test_trigger_answered_with_one_compaction_item_then_expanded(episode_gw: Any) -> None:
    async with episode_gw(["Working on it.", "Made one file; two to go.", "Next file."]) as gw:
        client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key=AGENT, http_client=gw.http, max_retries=0)
        first = await client.responses.create(model="m", input=TASK, max_output_tokens=16)
        history = [*TASK, {"type": "message", "role": "assistant", "content": first.output_text}]
        compacted = await client.responses.create(model="m", input=[*history, {"type": "compaction_trigger"}],
                                                  max_output_tokens=32)
        assert [o.type for o in compacted.output] == ["compaction"]
        item = compacted.output[0]
        turn_id, summary = compaction.expand(item.encrypted_content, "x")
        assert turn_id == compacted.id and summary == "Made one file; two to go."
        trigger = await gw.store.get_interaction(interaction_id=compacted.id)
        assert trigger.parent_id == first.id  # it continued the conversation token-exact
        assert trigger.request["messages"][-1]["content"] == compaction.TRIGGER_PROMPT
        assert trigger.request["params"] is not None and trigger.response_message["content"] == summary
        after = await client.responses.create(
            model="m", max_output_tokens=16,
            input=[*TASK, {"type": "compaction", "id": item.id, "encrypted_content": item.encrypted_content}])
        window = await gw.store.get_interaction(interaction_id=after.id)
        assert window.request["messages"][-1]["content"] == compaction.SUMMARY_PREFIX + summary


async def test_foreign_items_and_a_misplaced_trigger_are_400(episode_gw: Any) -> None:
    async with episode_gw(["unused"]) as gw:
        client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key=AGENT, http_client=gw.http, max_retries=0)
        for bad, param in (
                ([*TASK, {"type": "compaction", "encrypted_content": "FAKE-OPAQUE-BLOB"}], "input[1].encrypted_content"),
                ([{"type": "compaction_trigger"}, *TASK], "input[0]"),
                ([*TASK, {"type": "compaction", "encrypted_content": compaction.HANDLE_PREFIX + "resp_x.%%%"}],
                 "input[1].encrypted_content")):
            with pytest.raises(openai.BadRequestError) as caught:
                await client.responses.create(model="m", input=bad, max_output_tokens=8)
            assert caught.value.body["param"] == param, caught.value.body
        assert gw.svc.metrics.interactions.labels("root")._value.get() == 0  # nothing recorded
