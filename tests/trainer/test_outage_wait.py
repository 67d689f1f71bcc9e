"""The trainer waits out a gateway outage and never reuses a weight version (issue 36's chaos leftovers).

Real processes: ``agentrl train`` as a child process, a real gateway process (SQLite) killed with SIGKILL and
started again on the same port and database, the trainer tests' tiny engine. Everything waits on events
(lines in the trainer's log, answers of the gateway), bounded by a hang guard.

* A chaos run saw 47 trainer restarts in 10 minutes: every lease or registration that met a gateway that
  was down ended ``agentrl train`` with status 1. Now it waits (one log line per outage, one when it is
  over) and goes on; after ``--outage-give-up-s`` it stops with a message that says so.
* A trainer resumed from an older checkpoint published version numbers already used (``weight_regressions``
  in ``bench/chaos_check.py``: v5 -> v2). Now it asks the gateway and the engines their version at start and
  continues above it.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from agentrl.procs import Child, Processes
from tests.conftest import free_port
from tests.gateway.conftest import ADMIN_KEY, AGENT_KEY
from tests.trainer.conftest import engine_version

HANG_GUARD_S = 180.0
OUTAGE = "peer unavailable"
OVER = "the outage is over"


def start_gateway(procs: Processes, port: int, db: str, engine: str) -> Child:
    child = procs.start(f"gateway-{port}-{len(procs.children)}", [
        sys.executable, "-m", "agentrl", "gateway", "--engine-url", engine, "--db", db, "--port", str(port),
        "--admin-key", ADMIN_KEY, "--agent-key", AGENT_KEY, "--log-level", "warning", "--health-interval-s", "1"])
    procs.wait_healthy(child, f"http://127.0.0.1:{port}/health", timeout_s=HANG_GUARD_S)
    return child


def start_trainer(procs: Processes, port: int, ckpt: Path, *extra: str) -> Child:
    return procs.start(f"trainer-{len(procs.children)}", [
        sys.executable, "-m", "agentrl", "train", "--gateway", f"http://127.0.0.1:{port}", "--admin-key", ADMIN_KEY,
        "--model", "tiny", "--sync-mode", "disk", "--checkpoint-dir", str(ckpt), "--lease-wait-s", "1", *extra])


def wait_log(child: Child, text: str, count: int) -> str:
    """Until ``text`` is in the child's log ``count`` times (the child must not exit meanwhile, unless
    that is how the line got there)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        log = child.log_path.read_text(errors="replace")
        if log.count(text) >= count:
            return log
        if child.proc.poll() is not None:
            pytest.fail(f"{child.name} exited with {child.proc.returncode} before {text!r} x{count}:\n{log[-3000:]}")
        assert time.monotonic() < deadline, f"no {text!r} x{count} in {child.name}'s log:\n{log[-3000:]}"
        time.sleep(0.1)


def kill(child: Child) -> None:
    child.proc.send_signal(signal.SIGKILL)
    child.proc.wait()


def test_the_trainer_waits_for_a_gateway_that_is_down_and_goes_on(tmp_path: Path, trainer_engine: str) -> None:
    port = free_port()
    db = f"sqlite+aiosqlite:///{tmp_path}/gw.db"
    with Processes(tmp_path / "logs") as procs:
        trainer = start_trainer(procs, port, tmp_path / "ckpt", "--outage-give-up-s", "3600")
        wait_log(trainer, OUTAGE, 1)  # no gateway yet: it waits instead of exiting
        gateway = start_gateway(procs, port, db, trainer_engine)
        wait_log(trainer, OVER, 1)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                          timeout=60) as admin:
            deadline = time.monotonic() + HANG_GUARD_S  # registration follows the version read
            while admin.get("/v1/trajectories/stats").json()["trainer"] is None:
                assert time.monotonic() < deadline, "the trainer never registered"
                time.sleep(0.1)

        kill(gateway)  # while the trainer long-polls for leases
        wait_log(trainer, OUTAGE, 2)
        start_gateway(procs, port, db, trainer_engine)  # same port, same database
        log = wait_log(trainer, OVER, 2)
        assert trainer.proc.poll() is None  # it never exited
        # one line when each outage starts, one when it ends, however many attempts were made in between
        assert log.count(OUTAGE) == 2 and log.count(OVER) == 2, log[-3000:]
        assert "agentrl train:" not in log  # no exit message


def test_the_trainer_gives_up_after_its_outage_limit_with_a_clear_message(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    with Processes(tmp_path / "logs") as procs:
        trainer = start_trainer(procs, port, tmp_path / "ckpt", "--outage-give-up-s", "0")
        assert trainer.proc.wait(timeout=HANG_GUARD_S) == 1
        log = trainer.log_path.read_text(errors="replace")
        assert log.count(OUTAGE) == 1, log[-3000:]
        assert "gave up after" in log and "--outage-give-up-s 0" in log, log[-3000:]


def checkpoint_at(path: Path, version: int, tiny_model_dir: Path, dist_info) -> Path:
    """A trainer checkpoint of the tiny model's weights at step and version ``version``."""
    from trainer import checkpoint
    from trainer.model import load_model

    model = load_model(tiny_model_dir, dtype="float32", device=torch.device("cpu"))
    checkpoint.save(path, checkpoint.TrainerState(step=version, version=version), model, None, dist_info,
                    source_dir=tiny_model_dir)
    return path


def test_a_resume_from_an_older_checkpoint_continues_above_the_served_version(
        tmp_path: Path, trainer_engine: str, tiny_model_dir: Path, dist_info) -> None:
    # a checkpoint at version 2 (the trainer had reached 7 and was killed before saving again)
    checkpoint_at(tmp_path / "ckpt", 2, tiny_model_dir, dist_info)
    port = free_port()
    db = f"sqlite+aiosqlite:///{tmp_path}/gw.db"
    with Processes(tmp_path / "logs") as procs:
        start_gateway(procs, port, db, trainer_engine)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                          timeout=60) as admin:
            # the system serves version 7: the engine's weights are labelled 7 and so is the gateway
            resp = httpx.post(f"{trainer_engine}/update_weight_version",
                              json={"new_version": "7", "abort_all_requests": False}, timeout=60)
            assert resp.status_code == 200, resp.text
            assert admin.post("/admin/resume", json={"weight_version": 7}).status_code == 200
            trainer = start_trainer(procs, port, tmp_path / "ckpt", "--max-idle-s", "1")
            assert trainer.proc.wait(timeout=HANG_GUARD_S) == 0, trainer.tail()
            log = trainer.log_path.read_text(errors="replace")
            # the checkpoint's weights are not the ones served as 7: they get a number of their own
            assert "weight version 8" in log, log[-3000:]
            assert engine_version(trainer_engine) == 8
            assert admin.get("/admin/weight_version").json()["weight_version"] == 8
