"""Engine tests talk HTTP to a real `python -m agentrl engine --model tiny` process."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.conftest import REPO, free_port


@contextmanager
def engine_process(*extra: str, startup_timeout: float = 120.0) -> Iterator[str]:
    """Start the engine on a free port, wait for /health, yield its base URL; terminate it afterwards."""
    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a full pipe would block the engine
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl", "engine", "--model", "tiny", "--port", str(port), "--test-hooks", *extra],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"engine exited with {proc.returncode}:\n{log.read()}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("engine did not become healthy in time")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="session")
def engine_url() -> Iterator[str]:
    """One tiny engine for all engine tests (start-up dominates their cost on a shared 2-core machine).
    Tests that change its weights restore the original ones before they end."""
    with engine_process("--health-timeout-s", "2") as url:  # /health behind a pause answers 503 in 2 s
        yield url


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    """The same tiny model in this process, for reference forward passes."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def reference_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    """log p(output[k] | prompt + output[:k]) from one plain forward pass over prompt + output."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return [logprobs[len(prompt) - 1 + k, tok].item() for k, tok in enumerate(output)]


@contextmanager
def running_generation(url: str) -> Iterator[list[str]]:
    """A streamed generation held by the engine (``--test-hooks``) at its first token for the whole block:
    running and unfinished however fast the machine is; aborted afterwards. Yields its ``data:`` lines."""
    import threading

    from tests.engine_hooks import held_decoding, wait_for, wait_held

    events: list[str] = []
    body = {"input_ids": [1, 2, 3], "stream": True,
            "sampling_params": {"max_new_tokens": 64, "ignore_eos": True, "temperature": 0.0}}

    def read() -> None:
        with httpx.stream("POST", url + "/generate", json=body, timeout=120) as resp:
            events.extend(line for line in resp.iter_lines() if line.startswith("data: "))

    reader = threading.Thread(target=read)
    try:
        with held_decoding(url, 1):
            reader.start()
            wait_held(url)
            wait_for(lambda: events, "the first streamed event")
            assert '"finish_reason":null' in events[0].replace(" ", ""), events[0]  # running, not refused
            yield events
            httpx.post(url + "/abort_request", json={"abort_all": True}, timeout=60)
    finally:
        httpx.post(url + "/abort_request", json={"abort_all": True}, timeout=60)
        if reader.is_alive():
            reader.join(60)
