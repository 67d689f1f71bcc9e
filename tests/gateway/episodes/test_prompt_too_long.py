"""A Messages request over the context is a 400 worded as Anthropic's (``prompt is too long: N tokens > M
maximum``): Claude Code compacts its history on that error and sends again (capture B2b), on any other
wording its run ends. Driven by the real ``anthropic`` SDK; nothing is recorded for the refused request."""

from __future__ import annotations

import re
from typing import Any

import anthropic
import httpx2
import pytest

from tests.gateway.episodes.conftest import AGENT


async def test_messages_over_the_context_say_prompt_is_too_long(episode_gw: Any) -> None:
    async with episode_gw(["ok"], context_length=64) as gw:
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=gw.app), timeout=30)  # the SDK's httpx
        client = anthropic.AsyncAnthropic(base_url="http://gw", api_key=AGENT, http_client=http, max_retries=0)
        long_text = " ".join(f"word{i}" for i in range(80))
        with pytest.raises(anthropic.BadRequestError) as caught:
            await client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": long_text}])
        error = caught.value.body["error"]
        assert error["type"] == "invalid_request_error"
        found = re.match(r"prompt is too long: (\d+) tokens > 64 maximum", error["message"])
        assert found and int(found.group(1)) > 64, error["message"]
        assert gw.svc.metrics.interactions.labels("root")._value.get() == 0
        # under the context it is served
        reply = await client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        assert reply.content[0].text == "ok"
