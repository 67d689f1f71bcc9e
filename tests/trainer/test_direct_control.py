"""Pushing without a gateway while requests run (``DirectControl``), against SGLang's flush rules.

SGLang flushes its prefix cache only on an idle scheduler (``Scheduler.flush_cache``): 0.5.19 needs no running
and no queued request, and a weight update with ``flush_cache`` that finds any asserts (the server dies);
0.5.23 ignores the queue while paused and answers the update 400 when requests still run. Pause modes
(``Scheduler.pause_generation``): ``in_place`` leaves running requests in the batch, ``retract`` moves them
back to the queue. The fake below holds exactly that state, at the HTTP boundary (``httpx.MockTransport``).
"""

from __future__ import annotations

import json

import httpx
import pytest

from trainer.model import load_model
from trainer.weight_sync import DirectControl, DiskSync, push_weights


class SGLangFlushRules:
    def __init__(self, version: str, running: int) -> None:
        self.version, self.running, self.queued = version, running, 0
        self.paused, self.dead, self.calls = False, False, []

    def idle(self) -> bool:
        if self.version == "0.5.23" and self.paused:
            return self.running == 0
        return self.running == 0 and self.queued == 0

    def handler(self, request: httpx.Request) -> httpx.Response:
        if self.dead:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        self.calls.append((path, body))
        if path == "/pause_generation":
            self.paused = True
            if body.get("mode") == "retract":
                self.queued, self.running = self.queued + self.running, 0
            return httpx.Response(200, json={"message": "Generation paused successfully.", "status": "ok"})
        if path == "/continue_generation":
            self.paused = False
            return httpx.Response(200, json={"message": "Generation continued successfully.", "status": "ok"})
        if path == "/flush_cache":
            return httpx.Response(200 if self.idle() else 400, text="Cache flushed.\n" if self.idle() else
                                  "Flush cache failed.\n")
        if path == "/update_weights_from_disk":
            if body.get("flush_cache", True) and not self.idle():
                if self.version == "0.5.19":
                    self.dead = True  # AssertionError: Cache flush failed after updating weights
                    raise httpx.RemoteProtocolError("server disconnected", request=request)
                return httpx.Response(400, json={"success": False, "message": "Weights were updated, but the cache "
                                                 "was not flushed because requests are still running or queued."})
            return httpx.Response(200, json={"success": True, "message": "Succeeded to update model weights.",
                                             "num_paused_requests": 0})
        return httpx.Response(404, json={"detail": "Not Found"})


@pytest.mark.parametrize("version", ["0.5.19", "0.5.23"])
def test_direct_push_with_requests_in_flight_keeps_sglang_alive(version, tiny_model_dir, dist_info, tmp_path):
    engine = SGLangFlushRules(version, running=3)
    client = httpx.Client(transport=httpx.MockTransport(engine.handler))
    model = load_model(tiny_model_dir)
    result = push_weights(model, 1, info=dist_info, control=DirectControl(["http://sglang"], client=client),
                          transport=DiskSync(sync_dir=tmp_path, source_dir=tiny_model_dir, client=client),
                          retries=1, backoff_s=0)
    assert result.version == 1 and not engine.dead and not engine.paused
    paths = [p for p, _ in engine.calls]
    assert paths == ["/pause_generation", "/update_weights_from_disk", "/flush_cache", "/continue_generation"]
    assert engine.calls[1][1]["flush_cache"] is False
    assert engine.queued == 3  # the retracted requests are still there, to run after continue
