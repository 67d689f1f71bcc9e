"""Write .env.example: the variables docker-compose.yml interpolates, then every AGENTRL_* setting.

    python docker/make_env_example.py          # rewrites .env.example at the repository root

The AGENTRL_* part is generated from the settings dataclasses (help text, default), so it cannot drift from
the code; tests/deploy/test_compose.py checks that every setting is listed. Settings are written commented
out (the default applies); uncomment a line to set it. docker-compose.yml passes the file to the gateway,
trainer and agent containers (``env_file: .env``), so each process picks up the settings of its prefix.
Flags given in docker-compose.yml's command lines take precedence over these variables.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# (name, value written, active?, comment). Active lines are needed by docker-compose.yml (or are the
# values most people change); the rest show the default that docker-compose.yml falls back to.
COMPOSE_VARIABLES: list[tuple[str, str, bool, str]] = [
    ("COMPOSE_PROJECT_NAME", "agentrl", True, "Compose project name (prefix of containers, volumes, network)"),
    ("ADMIN_KEY", "change-me-admin-key", True,
     "Admin key of the gateway (engines, pause/resume, trajectories, trainer version): the trainer's"),
    ("RUNNER_KEY", "change-me-runner-key", True,
     "Runner key: sessions, groups, rewards, finish/abandon only; the agent runner uses it"),
    ("AGENT_KEY", "change-me-agent-key", True,
     "Agent key: agents that only know a base URL and a key are served in implicit mode with it"),
    ("POSTGRES_PASSWORD", "change-me-postgres", True, "Password of the PostgreSQL user (used in the gateway's --db URL)"),
    ("POSTGRES_USER", "agentrl", False, "PostgreSQL user"),
    ("POSTGRES_DB", "agentrl", False, "PostgreSQL database of the gateway's store"),
    ("POSTGRES_TAG", "16-alpine", False, "postgres image tag"),
    ("REDIS_TAG", "7-alpine", False, "redis image tag"),
    ("SGLANG_TAG", "v0.5.23-cu129", True,
     "lmsysorg/sglang image tag, pinned (the wire format and this command line are checked against SGLang "
     "0.5.19 and 0.5.23's own code); "
     "CUDA 13 tags (e.g. v0.5.22) need a CUDA 13 driver"),
    ("IMAGE_TAG", "latest", False, "tag of the locally built agentrl-gateway / agentrl-trainer images"),
    ("MODEL_DIR", "./models", True,
     "Host directory holding Hugging Face model directories, mounted read-only at /models in sglang, "
     "gateway and trainer (nothing is downloaded at run time). A Hugging Face cache works too: "
     "MODEL_DIR=~/.cache/huggingface/hub with MODEL_PATH=/models/models--ORG--NAME/snapshots/REVISION"),
    ("MODEL_PATH", "/models/SmolLM2-135M-Instruct", True,
     "The policy model as seen inside the containers: SGLang serves it, the gateway uses its tokenizer and "
     "chat template, the trainer starts from it"),
    ("SGLANG_GPU", "0", True, "GPU id reserved for SGLang"),
    ("SGLANG_MEM_FRACTION", "0.85", False,
     "SGLang --mem-fraction-static (lower it, e.g. 0.4, when SGLang and the trainer share one GPU)"),
    ("SGLANG_DTYPE", "bfloat16", False, "SGLang --dtype"),
    ("SGLANG_MAX_RUNNING_REQUESTS", "256", False, "SGLang --max-running-requests"),
    ("ENGINE_URLS", "http://sglang:30000", False,
     "Comma-separated SGLang URLs the gateway routes to; the trainer asks the gateway for them (GET "
     "/admin/engines) to push weights. More engines: add SGLang services and list them here"),
    ("GATEWAY_PORT", "8000", True, "Host port where the gateway's OpenAI-compatible API is published"),
    ("GATEWAY_PUBLIC_URL", "http://gateway:8000", False,
     "Base URL the gateway hands out in POST /v1/sessions (agents outside Compose: http://HOST:GATEWAY_PORT)"),
    ("TRAINER_GPU", "1", True, "GPU id reserved for the trainer (set to the SGLang GPU on a one-GPU host)"),
    ("TRAINER_NPROC", "1", False, "torchrun --nproc-per-node (one process per trainer GPU)"),
    ("TRAINER_DTYPE", "float32", False, "Parameter dtype of the trained model (float32 or bfloat16)"),
    ("TRAINER_BATCH_GROUPS", "8", False, "Finished GRPO groups per training step"),
    ("GROUP_SIZE", "8", True,
     "Sessions per prompt (the GRPO group size); the agent runner produces groups of this size and the "
     "trainer expects them"),
    ("WEIGHT_SYNC", "disk", True,
     "How new weights reach SGLang: disk (the shared `weights` volume + /update_weights_from_disk) or "
     "broadcast (NCCL: /init_weights_update_group + /update_weights_from_distributed)"),
    ("NCCL_PORT", "29600", False, "Port of the trainer's weight-broadcast group (WEIGHT_SYNC=broadcast)"),
    ("NCCL_SOCKET_IFNAME", "eth0", False, "Network interface NCCL uses between the trainer and SGLang containers"),
    ("DATA_DIR", "./data", False, "Host directory mounted read-only at /data in the agent container"),
    ("AGENT_DATASET", "gsm8k:/data/gsm8k", False,
     "Dataset of the example math agent (`agent` profile): gsm8k:DIR (DIR/train.jsonl) or synthetic:DIFFICULTY"),
    ("AGENT_CONCURRENCY", "32", False, "Sessions the agent runner drives at once"),
    ("AGENT_LIMIT", "1000", False, "Number of dataset prompts the agent runner uses"),
]

PROCESSES = {
    "AGENTRL_ENGINE_": "`agentrl engine` (embedded engine, no-Docker topology), ",
    "AGENTRL_GATEWAY_": "`agentrl gateway` (service gateway), ",
    "AGENTRL_TRAINER_": "`agentrl train` / `torchrun -m trainer` (service trainer), ",
    "AGENTRL_AGENT_": "`agentrl agent` (service agent), ",
    "AGENTRL_UP_": "`agentrl up` (single machine, not used by Compose), ",
}

DIRECT_HELP = {
    "AGENTRL_HOME": "where agentrl caches models (smollm2, tiny) and runs; default ~/.cache/agentrl "
                    "(/var/lib/agentrl in the images)",
}

HEADER = """\
# agentrl deployment settings: cp .env.example .env, set the keys and passwords, then `docker compose up -d`.
# Generated by docker/make_env_example.py from the settings classes; edit that script, not this file.
#
# Part 1: variables docker-compose.yml interpolates (image tags, GPUs, model directory, keys).
# Part 2: every AGENTRL_* setting of each process, commented out at its default. The gateway, trainer and
#         agent containers receive this file (env_file: .env); flags in docker-compose.yml win over it.
"""


def _render_default(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def settings_sections() -> list[str]:
    from tests.deploy.compose_file import class_env_names, direct_env_vars, settings_classes

    out = []
    classes = sorted(settings_classes(), key=lambda c: (next(iter(class_env_names(c).values())), c.__name__))
    for cls in classes:
        names = class_env_names(cls)
        prefix = next(iter(names.values()))[: -len(next(iter(names)))]
        process = PROCESSES.get(prefix, "")
        lines = [f"# ---- {prefix}* : {process}{cls.__module__}.{cls.__qualname__}"]
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                default = f.default_factory()  # type: ignore[misc]
            else:
                default = None
            help_text = " ".join(str(f.metadata.get("help", "")).split())
            lines.append(f"# {help_text}")
            lines.append(f"# {names[f.name]}={_render_default(default)}")
        out.append("\n".join(lines))
    direct = direct_env_vars()
    if direct:
        lines = ["# ---- read directly from the environment"]
        for var, module in sorted(direct.items()):
            lines.append(f"# {DIRECT_HELP.get(var, 'read by ' + module)} ({module})")
            lines.append(f"# {var}=")
        out.append("\n".join(lines))
    return out


def render() -> str:
    parts = [HEADER, "# ==== Part 1: docker-compose.yml variables"]
    for name, value, active, comment in COMPOSE_VARIABLES:
        parts.append(f"# {comment}")
        parts.append(f"{'' if active else '# '}{name}={value}")
    parts.append("")
    parts.append("# ==== Part 2: AGENTRL_* settings (flags > these variables > --config YAML > defaults)")
    parts.extend(section + "\n" for section in settings_sections())
    return "\n".join(parts).rstrip() + "\n"


if __name__ == "__main__":
    (REPO / ".env.example").write_text(render())
    print(f"wrote {REPO / '.env.example'}")
