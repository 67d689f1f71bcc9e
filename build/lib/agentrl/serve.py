"""`agentrl serve`: engine + gateway + trainer on this machine, for agents that run somewhere else.

    agentrl serve --model smollm2 --port 8000

Prints the gateway's URL and the keys to use, then trains on whatever groups the agents finish, until
Ctrl-C (every process it started is stopped then). Agents use `agentrl.client` with the printed key
(``Gateway(url, key).group(task, size)``), or any OpenAI SDK with the agent key (implicit episodes).
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

from agentrl import defaults
from agentrl.settings import SettingsError, add_arguments, load


@dataclass
class ServeSettings:
    """Settings of `agentrl serve` (env prefix ``AGENTRL_SERVE_``)."""

    env_prefix: ClassVar[str] = "AGENTRL_SERVE_"

    model: str = field(default="smollm2", metadata={"help": "smollm2, tiny or a Hugging Face model directory"})
    host: str = field(default="127.0.0.1", metadata={"help": "address the gateway listens on (0.0.0.0 for other machines)"})
    port: int = field(default=8000, metadata={"help": "gateway port"})
    public_url: str = field(default="", metadata={"help": "URL agents reach the gateway at (default http://host:port)"})
    admin_key: str = field(default="", metadata={"help": "admin key (creates groups; default: a random one, printed)"})
    agent_key: str = field(default="", metadata={"help": "agent key for implicit episodes (default: random, printed)"})
    group_size: int = field(default=defaults.GROUP_SIZE, metadata={"help": "sessions per GRPO group (told to the gateway by the trainer)"})
    batch_groups: int = field(default=defaults.BATCH_GROUPS, metadata={"help": "groups per trainer step"})
    lr: float = field(default=defaults.LR, metadata={"help": "trainer learning rate"})
    gamma: float = field(default=defaults.GAMMA, metadata={"help": "discount along each root-to-leaf path (gateway)"})
    steps: int = field(default=0, metadata={"help": "trainer steps to run (0 = until Ctrl-C)"})
    save_every: int = field(default=10, metadata={"help": "checkpoint every N steps (the newest few are kept)"})
    out_dir: str = field(default="", metadata={"help": "logs, database, checkpoints (default runs/serve-<time>)"})
    db: str = field(default="", metadata={"help": "gateway database URL (default SQLite in out_dir)"})
    redis: str = field(default="", metadata={"help": "Redis URL for the gateway (default none)"})
    engine_url: str = field(default="", metadata={"help": "use this SGLang/embedded engine instead of starting one"})
    device: str = field(default="cpu", metadata={"help": "device of the embedded engine and trainer", "choices": ("cpu", "cuda")})

    def validate(self) -> None:
        if self.group_size < 2:
            raise SettingsError("--group-size must be at least 2: GRPO compares sessions within a group")
        if not 0 < self.port < 65536:
            raise SettingsError(f"--port {self.port} is not a valid TCP port")
        self.admin_key = self.admin_key or secrets.token_urlsafe(16)
        self.agent_key = self.agent_key or "agent-" + secrets.token_urlsafe(12)
        if self.admin_key == self.agent_key:
            raise SettingsError("--agent-key must differ from --admin-key")
        if not self.out_dir:
            self.out_dir = str(Path("runs") / time.strftime("serve-%Y%m%d-%H%M%S"))


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("serve", help="engine + gateway + trainer for agents that run elsewhere (until Ctrl-C)",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, ServeSettings)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agentrl.procs import ChildFailed

    try:
        settings = load(ServeSettings, args)
    except SettingsError as exc:
        print(f"agentrl serve: {exc}", file=sys.stderr)
        return 2
    try:
        serve(settings)
    except KeyboardInterrupt:
        print("\nagentrl serve: stopped; every process it started has been stopped", file=sys.stderr)
        return 0
    except ChildFailed as exc:
        print(f"agentrl serve: {exc}", file=sys.stderr)
        return 1
    return 0


def serve(settings: ServeSettings) -> None:
    """Start everything, print how to connect, and wait (until Ctrl-C, a child's death or the last step)."""
    import json

    from agentrl.procs import Processes
    from agentrl.up import _free_port

    out = Path(settings.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "settings.json").write_text(json.dumps({**asdict(settings), "admin_key": "***", "agent_key": "***"}, indent=2))
    with Processes(out / "logs") as procs:
        engine_url = settings.engine_url
        if not engine_url:
            port = _free_port()
            print(f"[agentrl serve] starting engine ({settings.model}) on :{port}", flush=True)
            engine = procs.start_agentrl("engine", ["engine", "--model", settings.model, "--port", str(port),
                                                    "--device", settings.device])
            engine_url = f"http://127.0.0.1:{port}"
            procs.wait_healthy(engine, engine_url + "/health", timeout_s=600)
        public = settings.public_url or f"http://{'127.0.0.1' if settings.host in ('0.0.0.0', '::') else settings.host}:{settings.port}"
        local = f"http://127.0.0.1:{settings.port}"
        db = settings.db or f"sqlite+aiosqlite:///{out / 'gateway.db'}"
        gateway_args = ["gateway", "--engine-url", engine_url, "--db", db, "--host", settings.host,
                        "--port", str(settings.port), "--public-url", public, "--admin-key", settings.admin_key,
                        "--agent-key", settings.agent_key, "--gamma", str(settings.gamma)]
        if settings.redis:
            gateway_args += ["--redis", settings.redis]
        print(f"[agentrl serve] starting gateway on {public}", flush=True)
        gateway = procs.start_agentrl("gateway", gateway_args)
        procs.wait_healthy(gateway, local + "/health", timeout_s=300)
        trainer = procs.start_agentrl("trainer", [
            "train", "--gateway", local, "--admin-key", settings.admin_key, "--model", settings.model,
            "--steps", str(settings.steps), "--group-size", str(settings.group_size),
            "--batch-groups", str(settings.batch_groups), "--lr", str(settings.lr),
            "--checkpoint-dir", str(out / "trainer"), "--save-every", str(settings.save_every),
            "--device", settings.device, "--no-resume", "--micro-batch-tokens", "8192",
        ])
        print(connect_text(settings, public, out), flush=True)
        while True:
            if settings.steps and trainer.proc.poll() == 0:
                print(f"[agentrl serve] the trainer finished its {settings.steps} steps; checkpoints in "
                      f"{out / 'trainer'}", flush=True)
                return
            procs.check_alive()
            time.sleep(1.0)


def connect_text(settings: ServeSettings, public: str, out: Path) -> str:
    return "\n".join([
        "",
        "agentrl serve: ready. Point your agents here:",
        f"  gateway URL:  {public}",
        f"  base URL:     {public}/v1   (OpenAI SDKs; sessions get their own .../sessions/<id>/v1)",
        f"  admin key:    {settings.admin_key}   (agentrl.client: Gateway(url, key).group(task, size={settings.group_size}))",
        f"  agent key:    {settings.agent_key}   (any OpenAI SDK without sessions: implicit episodes)",
        f"  trainer:      {settings.batch_groups} groups of {settings.group_size} per step; metrics in "
        f"{out / 'trainer' / 'metrics.jsonl'}",
        f"  logs:         {out / 'logs'}",
        f"  trace viewer: {public}/ui   (log in with the admin key)",
        "Ctrl-C stops everything.",
        "",
    ])
