"""Property-based fuzzing of a real gateway process over its own OpenAPI document (schemathesis):
a bounded number of generated requests per operation, with every key role; none may get a 5xx."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import GatewayProc
from tests.gateway.test_openai_inprocess import ADMIN, make_gw, tokenizer  # noqa: F401 (fixtures)

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402  (after the importorskip)

EXAMPLES = 8  # per operation and key: bounded, the suite must stay fast

JSON_BODY_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                    "/v1/messages/count_tokens", "/v1/sessions", "/reward")


async def test_openapi_documents_the_body_of_every_generation_route(make_gw: Any) -> None:
    """The fuzzer generates bodies only for routes whose body the document describes; every ``$ref`` in it
    resolves."""
    async with make_gw(["a"]) as gw:
        doc = (await gw.http.get("/openapi.json", headers={"Authorization": f"Bearer {ADMIN}"})).json()
    schemas = doc["components"]["schemas"]
    for path in JSON_BODY_ROUTES:
        body = doc["paths"][path]["post"].get("requestBody")
        assert body is not None, f"POST {path} has no request body in /openapi.json"
        assert body["content"]["application/json"]["schema"], path
    refs = {m for m in re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(doc))}
    assert refs and refs <= set(schemas), refs - set(schemas)
    assert {"ResponsesRequest", "MessagesRequest", "CountTokensRequest"} <= {
        doc["paths"][p]["post"]["requestBody"]["content"]["application/json"]["schema"].get("title")
        for p in ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens")}


@pytest.mark.slow
def test_no_generated_request_gets_a_5xx(gateway_factory: Callable[..., GatewayProc]) -> None:
    # a short context: generated prompts are mostly refused (400) instead of generating thousands of tokens
    gw = gateway_factory(extra_args=("--context-length", "96", "--default-max-tokens", "4"))
    session = gw.create_session(group_id="fuzz")
    admin = {"Authorization": f"Bearer {gw.admin_key}"}
    assert httpx.get(gw.base_url + "/openapi.json", timeout=30).status_code == 401
    assert httpx.get(gw.base_url + "/openapi.json", headers={"Authorization": f"Bearer {gw.agent_key}"},
                     timeout=30).status_code == 403
    doc = httpx.get(gw.base_url + "/openapi.json", headers=admin, timeout=30)
    assert doc.status_code == 200 and "/v1/chat/completions" in doc.json()["paths"]
    schema = schemathesis.openapi.from_dict(doc.json())
    keys = [gw.admin_key, gw.agent_key, session["api_key"]]
    failures: list[str] = []
    calls = 0

    for operation in schema.get_all_operations():
        op = operation.ok()
        if op.path in ("/admin/pause",):  # pausing would hold the next operations' generations
            continue

        @settings(max_examples=EXAMPLES, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), database=None)
        @given(case=op.as_strategy())
        def check(case: Any) -> None:
            nonlocal calls
            for key in keys:
                resp = case.call(base_url=gw.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
                calls += 1
                if resp.status_code >= 500 and resp.status_code != 503:
                    failures.append(f"{case.method} {case.formatted_path} {case.body!r:.200} -> "
                                    f"{resp.status_code} {resp.text[:200]}")

        check()
    httpx.post(gw.base_url + "/admin/resume", json={"weight_version": 0}, headers=admin, timeout=30)
    assert calls > 50
    assert not failures, "\n".join(failures[:10])
