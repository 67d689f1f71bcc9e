"""The gateway's edge: malformed JSON of any type is a 400 (never a 500), client-chosen names stay bounded."""

from __future__ import annotations

from typing import Any

from gateway.metrics import MAX_UNKNOWN_FIELD_LABELS
from tests.gateway.test_openai_inprocess import ADMIN, AGENT, Gw, make_gw, tokenizer  # noqa: F401 (fixtures)

OK = [{"role": "user", "content": "hi"}]


async def _post(gw: Gw, path: str, body: Any, key: str = AGENT) -> Any:
    resp = await gw.post(path, body, key=key)
    assert resp.status_code < 500, (path, body, resp.status_code, resp.text)
    return resp


async def test_wrong_json_types_are_400_with_the_json_path(make_gw: Any) -> None:
    async with make_gw(["a"]) as gw:
        cases: list[tuple[Any, str]] = [
            ({"messages": [{"role": {}, "content": "x"}]}, "messages[0].role"),
            ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
            ({"messages": [{"role": "user", "content": [{"type": {}, "text": "x"}]}]}, "messages[0].content[0].type"),
            ({"messages": [{"role": "user", "content": [{"type": ["text"]}]}]}, "messages[0].content[0].type"),
            ({"messages": OK, "seed": 10**30}, "seed"),
            ({"messages": OK, "max_tokens": 10**23}, "max_tokens"),
            ({"messages": OK, "n": 10**23}, "n"),
        ]
        for body, param in cases:
            resp = await _post(gw, "/v1/chat/completions", {"model": "m", **body})
            assert resp.status_code == 400, (body, resp.text)
            assert resp.json()["error"]["param"] == param, resp.text
        for body in ({"version": 1, "batch_size": 10**22 + 7, "staleness_bound": 1},
                     {"version": 10**22, "batch_size": 4, "staleness_bound": 1},
                     {"version": 1, "batch_size": 4, "staleness_bound": 10**22}):
            resp = await _post(gw, "/admin/trainer", body, key=ADMIN)
            assert resp.status_code == 400, resp.text
        resp = await _post(gw, "/admin/resume", {"weight_version": 10**22}, key=ADMIN)
        assert resp.status_code == 400
        # nothing of the above was recorded; a good request still works afterwards
        good = await _post(gw, "/v1/chat/completions", {"model": "m", "messages": OK, "max_tokens": 2})
        assert good.status_code == 200


async def test_unknown_field_names_are_a_bounded_label_set(make_gw: Any) -> None:
    async with make_gw(["a"]) as gw:
        junk = {f"junk_{i}": 1 for i in range(MAX_UNKNOWN_FIELD_LABELS + 40)}
        resp = await _post(gw, "/v1/chat/completions", {"messages": OK, "max_tokens": 1, **junk})
        assert resp.status_code == 200
        text = (await gw.http.get("/metrics")).text
        labels = [line for line in text.splitlines() if line.startswith("agentrl_gateway_unknown_fields_total{")]
        assert len(labels) == MAX_UNKNOWN_FIELD_LABELS + 1
        assert 'agentrl_gateway_unknown_fields_total{field="junk_0"} 1.0' in text
        assert 'agentrl_gateway_unknown_fields_total{field="_other"} 40.0' in text


async def test_huge_input_is_refused_before_rendering_and_health_stays_live(make_gw: Any) -> None:
    async with make_gw(["a"]) as gw:
        rendered: list[int] = []
        render = gw.svc.template.render

        def counting(*args: Any, **kw: Any) -> Any:
            rendered.append(1)
            return render(*args, **kw)

        gw.svc.template.render = counting
        huge = {"model": "m", "messages": [{"role": "user", "content": "word " * 1_500_000}]}  # 7.5 MB
        resp = await _post(gw, "/v1/chat/completions", huge)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
        assert rendered == []  # refused from its size alone
        ok = await _post(gw, "/v1/chat/completions", {"model": "m", "messages": OK, "max_tokens": 2})
        assert ok.status_code == 200 and rendered == [1]
        assert (await gw.http.get("/health")).status_code == 200


async def test_a_failure_inside_one_streamed_choice_ends_the_stream_with_an_error_event(
        make_gw: Any, monkeypatch: Any) -> None:
    import asyncio

    from gateway.decoding import ChoiceDecoder

    async with make_gw(["hello there"]) as gw:
        def broken(self: Any, gen: Any) -> Any:
            raise RuntimeError("a bug in the decoder")

        body = {"model": "m", "messages": OK, "max_tokens": 5, "stream": True, "n": 2}
        monkeypatch.setattr(ChoiceDecoder, "step", broken)
        async with asyncio.timeout(20):  # it used to hang forever
            resp = await gw.post("/v1/chat/completions", body)
        assert resp.status_code in (200, 500), resp.text
        if resp.status_code == 200:
            assert '"error"' in resp.text and resp.text.rstrip().endswith("data: [DONE]")


async def test_a_half_sent_body_times_out_with_408(make_gw: Any) -> None:
    import asyncio

    async with make_gw(["a"], body_timeout_s=0.5) as gw:
        async def slow_body() -> Any:
            yield b'{"model": "m", "messages": ['
            await asyncio.sleep(3)  # the rest never comes in time
            yield b']}'

        async with asyncio.timeout(10):
            resp = await gw.http.post("/v1/chat/completions", content=slow_body(),
                                      headers={"Authorization": f"Bearer {AGENT}",
                                               "Content-Type": "application/json"})
        assert resp.status_code == 408 and resp.json()["error"]["code"] == "request_timeout"
