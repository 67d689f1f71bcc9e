"""What differs between SGLang 0.5.19 and 0.5.23, as the engine kind learns it (``engines.sglang``).

Fakes at the HTTP boundary (``httpx.MockTransport``) answer in each release's shapes, read in its wheel:
``/server_info`` (``version``, ``tp_size``; both releases, the ``get_`` names deprecated), the session routes
of 0.5.23 (``entrypoints/http_server.py``; ``managers/scheduler_components/weight_updater.py``: a second
begin is refused while one is open, the distributed and tensor updates are refused outside one), and the
flush rules of each (``Scheduler.flush_cache``: 0.5.19 counts waiting requests, 0.5.23 ignores them while
paused). The same calls run against SGLang's own code in ``test_sglang_own_code.py``.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from engines.sglang import SGLangDialect, SGLangOps, dialect_from, release
from tests.sglang.own_code import NEWEST, PINNED


class FakeSGLang:
    """One SGLang server of ``version`` (or the embedded engine: ``version=None``, only the ``get_`` routes)."""

    def __init__(self, version: str | None, tp_size: int = 1, running: int = 0) -> None:
        self.version, self.tp_size = version, tp_size
        self.session = False
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.running, self.waiting, self.paused = running, 0, False

    def sessions(self) -> bool:
        return self.version is not None and release(self.version) >= (0, 5, 23)

    def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        self.calls.append((path, body))
        if path == "/server_info" and self.version is not None:
            return httpx.Response(200, json={"version": self.version, "tp_size": self.tp_size,
                                             "context_length": 2048})
        if path == "/get_server_info":
            return httpx.Response(200, json={"version": self.version or "agentrl-embedded-0.1",
                                             "tp_size": self.tp_size})
        if path in ("/begin_weight_update", "/end_weight_update") and self.sessions():
            opening = path == "/begin_weight_update"
            if self.session == opening:
                message = ("a weight-update session is already open; call end_weight_update() first" if opening
                           else "no weight-update session is open; call begin_weight_update() first")
                return httpx.Response(400, json={"success": False, "message": message})
            self.session = opening
            return httpx.Response(200, json={"success": True, "message": "Success"})
        if path in ("/update_weights_from_tensor", "/update_weights_from_distributed"):
            if self.sessions() and not self.session:
                return httpx.Response(400, json={"success": False, "message": f"{path[1:]} must run between "
                                                 "begin_weight_update() and end_weight_update()"})
            return httpx.Response(200, json={"success": True, "message": "Success"})
        if path == "/pause_generation":
            self.paused = True
            if body.get("mode") == "retract":
                self.waiting, self.running = self.waiting + self.running, 0
            return httpx.Response(200, json={"message": "Generation paused successfully.", "status": "ok"})
        if path == "/continue_generation":
            self.paused = False
            self.running, self.waiting = self.running + self.waiting, 0
            return httpx.Response(200, json={"message": "Generation continued successfully.", "status": "ok"})
        if path == "/flush_cache":
            ignore_waiting = self.paused and self.version is not None and release(self.version) >= (0, 5, 23)
            idle = self.running == 0 and (self.waiting == 0 or ignore_waiting)
            return httpx.Response(200 if idle else 400, text="Cache flushed.\n" if idle else "Flush cache failed.\n")
        if path == "/update_weights_from_disk":
            return httpx.Response(200, json={"success": True, "message": "ok", "num_paused_requests": 0})
        return httpx.Response(404, json={"detail": "Not Found"})


@pytest.fixture(scope="module")
def dist_info():
    from trainer.model import init_distributed

    return init_distributed("cpu")  # idempotent: joins the one-process default group once


def ops_for(fake: FakeSGLang) -> SGLangOps:
    return SGLangOps(httpx.Client(transport=httpx.MockTransport(fake.handler)), "http://sglang")


def test_the_dialect_is_read_from_the_servers_own_info() -> None:
    assert release("0.5.23") == (0, 5, 23) and release("0.5.19rc1") == (0, 5, 19)
    assert release("agentrl-embedded-0.1") is None and release(None) is None
    pinned, newest = (dialect_from({"version": v, "tp_size": 2}, info_routes=True) for v in (PINNED, NEWEST))
    assert (pinned.sessions, newest.sessions) == (False, True) and pinned.tp_size == newest.tp_size == 2
    assert pinned.model_info_route == "/model_info" and pinned.server_info_route == "/server_info"
    embedded = dialect_from({"version": "agentrl-embedded-0.1", "tp_size": 1}, info_routes=False)
    assert embedded.sessions is False and embedded.model_info_route == "/get_model_info"
    assert dialect_from({"version": "0.5.21"}, info_routes=True).sessions is None  # not read: the route decides
    assert SGLangDialect().model_info_route == "/get_model_info"  # before anything is known

    for version, routes in ((PINNED, ["/server_info"]), (NEWEST, ["/server_info"]),
                            (None, ["/server_info", "/get_server_info"])):
        fake = FakeSGLang(version, tp_size=2)
        ops = ops_for(fake)
        assert ops.dialect().tp_size == 2 and ops.dialect() is ops.dialect()  # read once
        assert [p for p, _ in fake.calls] == routes


@pytest.mark.parametrize("version", [PINNED, NEWEST, None])
def test_sessions_open_and_close_only_where_the_release_has_them(version) -> None:
    fake = FakeSGLang(version)
    ops = ops_for(fake)
    ops.begin_weight_update()
    assert fake.session is fake.sessions()
    ops.end_weight_update()
    assert not fake.session
    sent = [p for p, _ in fake.calls if p.endswith("_weight_update")]
    assert sent == (["/begin_weight_update", "/end_weight_update"] if fake.sessions() else [])
    for path, body in fake.calls:
        if path.endswith("_weight_update"):
            assert body == {}  # BeginWeightUpdateReqInput (selector "all" by default), EndWeightUpdateReqInput


def test_a_session_left_open_by_a_dead_trainer_is_closed_before_the_next_push() -> None:
    fake = FakeSGLang(NEWEST)
    fake.session = True  # an earlier trainer died between begin and end
    ops = ops_for(fake)
    ops.begin_weight_update()
    assert [p for p, _ in fake.calls if p.endswith("_weight_update")] == [
        "/begin_weight_update", "/end_weight_update", "/begin_weight_update"]
    assert fake.session


def test_a_release_between_those_read_is_tried_and_a_404_means_no_sessions() -> None:
    fake = FakeSGLang("0.5.21")  # the fake answers the session routes 404 for releases before 0.5.23
    ops = ops_for(fake)
    ops.begin_weight_update()
    ops.end_weight_update()
    ops.begin_weight_update()
    assert [p for p, _ in fake.calls if p.endswith("_weight_update")] == ["/begin_weight_update"]


@pytest.mark.parametrize("version", [PINNED, NEWEST])
def test_a_tensor_push_is_in_a_session_with_one_payload_per_rank(version, tiny_model_dir, dist_info) -> None:
    from trainer.model import load_model
    from trainer.weight_sync import TensorSync

    fake = FakeSGLang(version, tp_size=2)
    sync = TensorSync(client=httpx.Client(transport=httpx.MockTransport(fake.handler)))
    model = load_model(tiny_model_dir)
    staged = sync.stage(model, 1, dist_info)
    updated: list[str] = []
    sync.send(["http://sglang"], 1, staged, updated)
    sync.committed(staged)
    assert updated == ["http://sglang"] and not fake.session
    (body,) = [b for p, b in fake.calls if p == "/update_weights_from_tensor"]
    assert body["serialized_named_tensors"] == [staged, staged]
    paths = [p for p, _ in fake.calls if p != "/server_info"]
    assert paths == (["/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"]
                     if version == NEWEST else ["/update_weights_from_tensor"])


@pytest.mark.parametrize("version", [PINNED, NEWEST])
def test_a_direct_push_whose_flush_is_refused_reports_the_stale_prefix_cache(version, tiny_model_dir, dist_info,
                                                                            tmp_path, caplog) -> None:
    """Without a gateway the engines pause in ``retract`` mode and flush while still paused. 0.5.23 accepts
    (it ignores the waiting queue while paused); 0.5.19 refuses while retracted requests wait. The flush is
    not retried (once they run again 0.5.19's scheduler is not idle until they end, and they would already
    have re-used the cached prefixes): the push reports it (``stale_cache_engines``, and a warning)."""
    from trainer.model import load_model
    from trainer.weight_sync import DirectControl, DiskSync, push_weights

    fake = FakeSGLang(version, running=3)
    client = httpx.Client(transport=httpx.MockTransport(fake.handler))
    control = DirectControl(["http://sglang"], client=client)
    result = push_weights(load_model(tiny_model_dir), 1, info=dist_info, control=control, retries=1, backoff_s=0,
                          transport=DiskSync(sync_dir=tmp_path, source_dir=tiny_model_dir, client=client))
    stale = version == PINNED
    assert result.stale_cache_engines == (1 if stale else 0)
    assert control.stale_cache == (["http://sglang"] if stale else [])
    assert ("kept its prefix cache" in caplog.text) is stale
    assert not fake.paused and fake.running == 3  # the retracted requests run again either way
