"""Settings of `agentrl engine` (flags > AGENTRL_ENGINE_* environment > --config YAML > defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from agentrl.settings import SettingsError


@dataclass
class EngineSettings:
    env_prefix: ClassVar[str] = "AGENTRL_ENGINE_"

    model: str = field(default="smollm2", metadata={"help": "smollm2, tiny, or a Hugging Face model directory"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=30000, metadata={"help": "TCP port to listen on"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda", "choices": ["cpu", "cuda"]})
    max_running_requests: int = field(
        default=64, metadata={"help": "most requests decoded together in one batch; more wait in a queue"}
    )
    context_length: int | None = field(
        default=None, metadata={"help": "longest prompt + output in tokens (default: the model's max_position_embeddings)"}
    )
    threads: int = field(
        default=1,
        metadata={"help": "torch intra-op CPU threads. 1 by default: on a shared CPU, more threads spin-wait on each "
                          "other (measured 18.7 s vs 1.0 s per batch-8 step of smollm2 at load 10 on 2 cores); "
                          "raise it on a dedicated machine"},
    )
    health_timeout_s: float = field(
        default=20.0,
        metadata={"help": "how long /health waits for its one-token generation before answering 503; like "
                          "SGLang (SGLANG_HEALTH_CHECK_TIMEOUT, 20 s) it waits behind a pause"},
    )
    log_level: str = field(default="warning", metadata={"help": "uvicorn/engine log level (debug, info, warning)"})
    lora_paths: list[str] = field(
        default_factory=list,
        metadata={"help": "LoRA adapters to load at start, NAME=PATH each (comma-separated; SGLang's --lora-paths "
                          "form): peft adapter directories, e.g. a LoRA trainer's checkpoint (docs/lora.md)"},
    )
    default_lora: str = field(
        default="",
        metadata={"help": "serve requests that name no adapter (no lora_path) with this LoRA adapter once it is loaded "
                          "(the base model until then): a LoRA trainer's pushes then reach a gateway that names no "
                          "adapter. An agentrl extension; SGLang and vLLM need every request to name it (docs/lora.md)"},
    )
    test_hooks: bool = field(
        default=False,
        metadata={"help": "serve /test/hold_decoding and /test/release_decoding, which hold decoding at a token "
                          "count so that tests act mid-generation by event, not by sleeping (never in production)"},
    )

    def validate(self) -> None:
        if not 0 < self.port < 65536:
            raise SettingsError(f"port {self.port} is not a TCP port: use 1-65535 (e.g. --port 30000)")
        if self.device not in ("cpu", "cuda"):
            raise SettingsError(f"device {self.device!r}: use --device cpu or --device cuda")
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise SettingsError("--device cuda but no CUDA device is visible: use --device cpu")
        if self.max_running_requests < 1:
            raise SettingsError("max_running_requests must be at least 1 (e.g. --max-running-requests 64)")
        if self.health_timeout_s <= 0:
            raise SettingsError("health_timeout_s must be positive (e.g. --health-timeout-s 20)")
        if self.threads < 1:
            raise SettingsError("threads must be at least 1 (e.g. --threads 1)")
        for item in self.lora_paths:
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise SettingsError(f"--lora-paths {item!r}: give NAME=PATH (a peft adapter directory), e.g. "
                                    "policy=runs/trainer/step_000040")
        if self.context_length is not None and self.context_length < 2:
            raise SettingsError("context_length must be at least 2 tokens, or left unset to use the model's")
