"""A weight push that meets an engine that is down (503s, then back) is retried under the same version and
the batch is acknowledged only once it landed (issue 36's chaos leftovers: such a push ended ``agentrl train``
with status 1). The gateway and its engine are faked at the HTTP boundary (``tests/trainer/test_loop.py``'s
FakeGateway); the engine's outage is counted in requests, not in time."""

from __future__ import annotations

import logging

import httpx
import pytest

from tests.trainer.helpers import synthetic_rows
from tests.trainer.test_loop import FakeGateway, _settings
from trainer.loop import train
from trainer.weight_sync import WeightSyncError


class EngineDownFor(FakeGateway):
    """Its engine answers 503 to the first ``down`` weight updates (a restarting engine), then loads them."""

    def __init__(self, batches, down: int, status: int = 503) -> None:
        super().__init__(batches)
        self.down, self.status, self.refused = down, status, 0

    def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.host == "engine" and request.url.path == "/update_weights_from_disk" and self.refused < self.down:
            self.refused += 1
            self.admin.append((request.url.path, {}))
            return httpx.Response(self.status, json={"success": False, "message": "engine restarting"})
        return super().handler(request)


@pytest.mark.slow
def test_a_push_to_an_engine_that_is_down_waits_and_lands_under_the_same_version(tmp_path, dist_info, caplog):
    gw = EngineDownFor([synthetic_rows(2, 3, seed=4)], down=3)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        state = train(_settings(tmp_path, steps=1, sync_mode="disk", sync_retries=2), http=gw.client())
    assert (state.step, state.version) == (1, 1)
    assert gw.refused == 3 and gw.acked == ["lease-1"]
    loads = [body for path, body in gw.admin if path == "/update_weights_from_disk" and body]
    assert [b["weight_version"] for b in loads] == ["1"]  # the same number when it landed
    resumes = [body["weight_version"] for path, body in gw.admin if path == "/admin/resume"]
    assert resumes[-1] == 1 and set(resumes) <= {0, 1}  # rolled back to the served 0 between attempts
    text = caplog.text
    assert text.count("peer unavailable") == 1 and text.count("the outage is over") == 1, text


@pytest.mark.slow
def test_a_refusal_that_is_not_an_outage_still_stops_at_once(tmp_path, dist_info):
    gw = EngineDownFor([synthetic_rows(2, 3, seed=4)], down=100, status=400)
    with pytest.raises(WeightSyncError, match="engine restarting"):
        train(_settings(tmp_path, steps=1, sync_mode="disk", sync_retries=2, outage_give_up_s=3600), http=gw.client())
    assert gw.refused == 2 and gw.acked == []
