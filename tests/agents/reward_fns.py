"""Reward functions for the tests, in a module with light imports: RewardPool workers import it by name."""

import os
import time
from pathlib import Path


def accept_all(completion: str, reference: str) -> float:
    """Accepts any answer (the integration tests' stand-in for a verifier that agrees with the model)."""
    return 1.0


def sleeps_forever(completion: str, reference: str) -> float:
    time.sleep(60)
    return 1.0


def dies(completion: str, reference: str) -> float:
    os._exit(3)


def dies_once(marker: str, reference: str) -> float:
    """Crash the worker the first time (the marker file does not exist yet), answer 1.0 after."""
    path = Path(marker)
    if not path.exists():
        path.write_text("crashed")
        os._exit(3)
    return 1.0


def raises_once(marker: str, reference: str) -> float:
    path = Path(marker)
    if not path.exists():
        path.write_text("raised")
        raise RuntimeError("flaky reward")
    return 0.5


def returns_nan(completion: str, reference: str) -> float:
    return float("nan")
