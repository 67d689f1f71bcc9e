"""The embedded engine and the gateway that `agentrl up`, `serve` and `eval` start, and what they leave.

Each command line is built by a function of its own (``engine_argv``, ``gateway_argv``, ``trainer_argv``),
so a test can parse exactly what the supervisor runs with the children's real parsers; every flag is one
``--name=value`` word (:func:`agentrl.procs.flags`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from agentrl.procs import Processes, flags, free_port


def engine_argv(*, model: str, port: int, device: str, **extra: object) -> list[str]:
    return ["engine", *flags(model=model, port=port, device=device, **extra)]


def gateway_argv(*, engine_url: str, db: str, port: int, admin_key: str, **extra: object) -> list[str]:
    return ["gateway", *flags(engine_url=engine_url, db=db, port=port, admin_key=admin_key, **extra)]


def trainer_argv(*, gateway: str, admin_key: str, model: str, checkpoint_dir: Path, **extra: object) -> list[str]:
    """The trainer of a supervised run: never resumes (each run has its own directory)."""
    return ["train", *flags(gateway=gateway, admin_key=admin_key, model=model, checkpoint_dir=checkpoint_dir,
                            resume=False, **extra)]


def start_engine(procs: Processes, *, model: str, device: str, say=print, **extra: object) -> str:
    """Start the embedded engine on a free port; its URL once it answers ``/health``."""
    port = free_port()
    say(f"starting engine ({model}) on :{port}")
    engine = procs.start_agentrl("engine", engine_argv(model=model, port=port, device=device, **extra))
    url = f"http://127.0.0.1:{port}"
    procs.wait_healthy(engine, url + "/health", timeout_s=600)
    return url


def start_gateway(procs: Processes, argv: list[str], health_url: str) -> None:
    gateway = procs.start_agentrl("gateway", argv)
    procs.wait_healthy(gateway, health_url + "/health", timeout_s=300)


def remove_sync_copies(trainer_dir: Path) -> None:
    """Drop the trainer's disk-push copies (``sync/v<N>``, one model's weights each) once the run is over.

    The engines loaded them already and the final checkpoint holds the same weights; the trainer removes
    them itself when it ends normally, this covers a trainer stopped by a signal (``serve`` until Ctrl-C).
    """
    shutil.rmtree(trainer_dir / "sync", ignore_errors=True)
