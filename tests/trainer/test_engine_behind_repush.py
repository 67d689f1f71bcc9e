"""A trainer waiting for data pushes its weights again to an engine that went back to an older version
(issue 36's chaos leftovers: a restarted engine served the base weights as version 0 until the next step's
push, and with one engine no fresh data, hence no step, came: the gateway keeps an engine behind in rotation
when no other serves the current version).

Real processes: ``agentrl train`` resumed from a checkpoint at version 2 (it pushes it at start), a gateway
and the trainer tests' tiny engine; the engine is then set back to version 0 through its own API (what a
restart looks like to everyone), and the waiting trainer pushes version 2 again. Waits on the engine's
reported version and the trainer's log, bounded by a hang guard."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from agentrl.procs import Processes
from tests.conftest import free_port
from tests.trainer.conftest import engine_version
from tests.trainer.test_outage_wait import HANG_GUARD_S, checkpoint_at, start_gateway, start_trainer, wait_log


def wait_version(url: str, version: int, trainer) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while engine_version(url) != version:
        assert trainer.proc.poll() is None, trainer.tail()
        assert time.monotonic() < deadline, f"the engine never reported v{version}:\n{trainer.tail()}"
        time.sleep(0.1)


def test_a_waiting_trainer_pushes_again_to_an_engine_that_went_back(
        tmp_path: Path, trainer_engine: str, tiny_model_dir: Path, dist_info) -> None:
    checkpoint_at(tmp_path / "ckpt", 2, tiny_model_dir, dist_info)
    port = free_port()
    with Processes(tmp_path / "logs") as procs:
        start_gateway(procs, port, f"sqlite+aiosqlite:///{tmp_path}/gw.db", trainer_engine)
        trainer = start_trainer(procs, port, tmp_path / "ckpt")
        wait_version(trainer_engine, 2, trainer)  # the resume's push
        resp = httpx.post(f"{trainer_engine}/update_weight_version",
                          json={"new_version": "0", "abort_all_requests": False}, timeout=60)
        assert resp.status_code == 200, resp.text
        wait_log(trainer, "pushing the current weights again", 1)
        wait_version(trainer_engine, 2, trainer)
        assert trainer.proc.poll() is None
