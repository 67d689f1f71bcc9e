"""Property-based fuzzing of a real gateway process over its own OpenAPI document (schemathesis):
a bounded number of generated requests per operation, with every key role; none may get a 5xx."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import GatewayProc

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402  (after the importorskip)

EXAMPLES = 8  # per operation and key: bounded, the suite must stay fast


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
