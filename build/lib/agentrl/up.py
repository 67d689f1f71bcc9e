"""`agentrl up`: the whole loop on one machine with embedded defaults.

Starts the embedded engine (SmolLM2-135M-Instruct unless told otherwise), the gateway (SQLite, no Redis)
and the GRPO trainer as separate processes, then drives the example math agent through the gateway:

    evaluate (held-out split, greedy)  ->  for each step: one batch of groups -> trainer step -> new weights
                                       ->  evaluate again  ->  summary.json, reward_curve.png, checkpoint

Rounds are synchronous (the runner produces one batch, the trainer trains on it and pushes the weights,
then the next round starts), so every training rollout is on-policy and the curve reads step by step.
Every process it started is stopped on success, on error and on Ctrl-C. External PostgreSQL, Redis or
engine URLs replace the embedded ones with ``--db``, ``--redis`` and ``--engine-url``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx

from agentrl import defaults
from agentrl.settings import SettingsError, add_arguments, load


@dataclass
class UpSettings:
    """Settings of `agentrl up` (env prefix ``AGENTRL_UP_``)."""

    env_prefix: ClassVar[str] = "AGENTRL_UP_"

    model: str = field(default="smollm2", metadata={"help": "smollm2, tiny or a Hugging Face model directory"})
    quick: bool = field(default=False, metadata={"help": "a run of a few minutes: fewer steps, prompts and evals"})
    dataset: str = field(default="synthetic:1", metadata={"help": "training/eval task: synthetic[:DIFFICULTY] or gsm8k:PATH"})
    agent: str = field(default="math", metadata={"help": "example agent: math (multi-turn with self-correction) or tools; "
                                                          "or your own: module:function, an async episode function "
                                                          "(docs/own-agent.md) run on --dataset FILE.jsonl"})
    eval_dataset: str = field(default="", metadata={"help": "with --agent module:function: JSONL tasks evaluated before "
                                                            "and after training (default: the first --eval-limit "
                                                            "tasks of --dataset)"})
    steps: int = field(default=4, metadata={"help": "trainer steps (quick: 2)"})
    group_size: int = field(default=defaults.GROUP_SIZE, metadata={"help": "sessions per prompt (a GRPO group); the trainer tells the gateway"})
    batch_groups: int = field(default=4, metadata={"help": "groups per trainer step (quick: 2)"})
    eval_limit: int = field(default=20, metadata={"help": "held-out prompts evaluated before and after training (quick: 8)"})
    max_turns: int = field(default=2, metadata={"help": "model calls per episode (self-correction turns)"})
    max_tokens: int = field(default=96, metadata={"help": "max new tokens per model call"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature of training rollouts"})
    lr: float = field(default=defaults.LR, metadata={"help": "trainer learning rate"})
    gamma: float = field(default=defaults.GAMMA, metadata={"help": "discount along each root-to-leaf path (set on the gateway, which exports the returns)"})
    concurrency: int = field(default=16, metadata={"help": "agents running at once"})
    out_dir: str = field(default="", metadata={"help": "where logs, summary, plot and checkpoint go (default runs/<time>)"})
    db: str = field(default="", metadata={"help": "gateway database URL (default SQLite in out_dir)"})
    redis: str = field(default="", metadata={"help": "Redis URL for the gateway (default none)"})
    engine_url: str = field(default="", metadata={"help": "use this SGLang/embedded engine instead of starting one"})
    device: str = field(default="cpu", metadata={"help": "device of the embedded engine and trainer", "choices": ("cpu", "cuda")})
    engine_max_running: int = field(default=64, metadata={"help": "the embedded engine's --max-running-requests (decode batch); on a GPU raise it with --concurrency, e.g. 128"})
    sync_mode: str = field(default="auto", metadata={"help": "weight sync: disk, broadcast, tensor (CUDA IPC handles; engine and trainer on one GPU) or auto (tensor with --device cuda and the embedded engine, else disk)", "choices": ("auto", "disk", "broadcast", "tensor")})
    release_memory: str = field(default="none", metadata={"help": "during each train step the engine frees this GPU memory (none, kv_cache, or all: KV cache and weights) and takes it back before the weight push (SGLang's release/resume_memory_occupation)", "choices": ("none", "kv_cache", "all")})
    step_timeout_s: float = field(default=900.0, metadata={"help": "give up when one step takes longer than this"})

    def validate(self) -> None:
        if self.sync_mode == "auto":  # colocated on one GPU: weights by CUDA IPC handles, no copy through disk
            self.sync_mode = "tensor" if self.device == "cuda" and not self.engine_url else "disk"
        if self.quick:
            self.steps = min(self.steps, 2)
            self.batch_groups = min(self.batch_groups, 2)
            self.eval_limit = min(self.eval_limit, 8)
        if self.steps < 1:
            raise SettingsError("--steps must be at least 1")
        if self.group_size < 2:
            raise SettingsError("--group-size must be at least 2: GRPO compares sessions within a group")
        if ":" in self.agent:  # your own episode function: tasks come from a JSONL file
            if not self.dataset.endswith(".jsonl"):
                raise SettingsError(f"--agent {self.agent} runs on your tasks: pass --dataset FILE.jsonl "
                                    f"(one JSON object per line), not {self.dataset!r}")
            for name in ("dataset", "eval_dataset"):
                if getattr(self, name) and not Path(getattr(self, name)).is_file():
                    raise SettingsError(f"--{name.replace('_', '-')} {getattr(self, name)}: no such file")
        if not self.out_dir:
            self.out_dir = str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("up", help="the main job on one machine (embedded engine, SQLite, gateway, runner, trainer)",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, UpSettings)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        settings = load(UpSettings, args)
    except SettingsError as exc:
        print(f"agentrl up: {exc}", file=sys.stderr)
        return 2
    try:
        summary = up(settings)
    except KeyboardInterrupt:
        print("\nagentrl up: interrupted; every process it started has been stopped", file=sys.stderr)
        return 130
    except UpFailed as exc:
        print(f"agentrl up: {exc}", file=sys.stderr)
        return 1
    print(format_summary(summary))
    return 0


class UpFailed(RuntimeError):
    """A component failed; the message names it and the end of its log."""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def up(settings: UpSettings) -> dict[str, Any]:
    from agentrl.procs import ChildFailed, Processes

    out = Path(settings.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "settings.json").write_text(json.dumps(asdict(settings), indent=2))
    admin_key = secrets.token_urlsafe(16)  # the trainer's: pause/resume, leasing, trainer version
    runner_key = "runner-" + secrets.token_urlsafe(16)  # the agents': sessions, groups, rewards only
    t0 = time.monotonic()
    say = lambda msg: print(f"[agentrl up {time.monotonic() - t0:6.0f}s] {msg}", flush=True)  # noqa: E731

    try:
        with Processes(out / "logs") as procs:
            engine_url = settings.engine_url
            if not engine_url:
                port = _free_port()
                say(f"starting engine ({settings.model}) on :{port}")
                engine = procs.start_agentrl("engine", ["engine", "--model", settings.model, "--port", str(port),
                                                        "--device", settings.device,
                                                        "--max-running-requests", str(settings.engine_max_running)])
                engine_url = f"http://127.0.0.1:{port}"
                procs.wait_healthy(engine, engine_url + "/health", timeout_s=600)
            gport = _free_port()
            gateway_url = f"http://127.0.0.1:{gport}"
            db = settings.db or f"sqlite+aiosqlite:///{out / 'gateway.db'}"
            gateway_args = ["gateway", "--engine-url", engine_url, "--db", db, "--port", str(gport),
                            "--admin-key", admin_key, "--runner-key", runner_key, "--gamma", str(settings.gamma)]
            if settings.redis:
                gateway_args += ["--redis", settings.redis]
            say(f"starting gateway on :{gport} (db {db})")
            gateway = procs.start_agentrl("gateway", gateway_args)
            procs.wait_healthy(gateway, gateway_url + "/health", timeout_s=300)

            say("starting trainer")
            procs.start_agentrl("trainer", [
                "train", "--gateway", gateway_url, "--admin-key", admin_key, "--model", settings.model,
                "--steps", str(settings.steps), "--group-size", str(settings.group_size),
                "--batch-groups", str(settings.batch_groups), "--lr", str(settings.lr),
                "--checkpoint-dir", str(out / "trainer"), "--sync-mode", settings.sync_mode,
                "--device", settings.device, "--no-resume", "--micro-batch-tokens", "4096",
                "--release-memory", settings.release_memory,
            ])

            evals: dict[str, dict[str, Any]] = {}
            say(f"evaluating on {settings.eval_limit} held-out prompts (greedy)")
            evals["before"] = _run_agents(settings, gateway_url, runner_key, eval=True)
            say(f"eval before: turn-1 accuracy {evals['before']['accuracy_turn1']}, "
                f"final {evals['before']['accuracy_final']}, mean reward {evals['before']['mean_reward']}")

            steps: list[dict[str, Any]] = []
            for step in range(settings.steps):
                started = time.monotonic()
                summary = _run_agents(settings, gateway_url, runner_key, eval=False, offset=step * settings.batch_groups)
                _wait_for_version(procs, gateway_url, admin_key, step + 1, settings.step_timeout_s)
                row = {"step": step, "mean_reward": summary["mean_reward"] or 0.0,
                       "turn1_accuracy": summary["accuracy_turn1"] or 0.0,
                       "final_accuracy": summary["accuracy_final"] or 0.0,
                       "mean_turns": summary["mean_turns"], "episodes": summary["episodes"],
                       "seconds": round(time.monotonic() - started, 1)}
                steps.append(row)
                say(f"step {step + 1}/{settings.steps}: mean reward {row['mean_reward']:.3f}, turn-1 acc "
                    f"{row['turn1_accuracy']:.3f}, final acc {row['final_accuracy']:.3f} ({row['seconds']}s)")

            say("evaluating again")
            evals["after"] = _run_agents(settings, gateway_url, runner_key, eval=True)
            say(f"eval after: turn-1 accuracy {evals['after']['accuracy_turn1']}, "
                f"final {evals['after']['accuracy_final']}, mean reward {evals['after']['mean_reward']}")
            trainer = next(c for c in procs.children if c.name == "trainer")
            try:
                trainer.proc.wait(timeout=300)
            except Exception as exc:  # noqa: BLE001 - reported, then the context stops it
                raise UpFailed(f"trainer did not finish writing its checkpoint: {exc}") from exc
            if trainer.proc.returncode != 0:
                raise UpFailed(f"trainer exited with {trainer.proc.returncode}; log {trainer.log_path}:\n{trainer.tail()}")
    except ChildFailed as exc:
        raise UpFailed(str(exc)) from exc

    return _write_results(settings, out, steps, evals, time.monotonic() - t0)


def _run_agents(settings: UpSettings, gateway_url: str, admin_key: str, *, eval: bool, offset: int = 0) -> dict[str, Any]:
    from agents.runner import RunnerSettings, run_agents

    if ":" in settings.agent:
        return _run_episode_fn(settings, gateway_url, admin_key, eval=eval, offset=offset)

    runner = RunnerSettings(
        agent=settings.agent, gateway=gateway_url, admin_key=admin_key, dataset=settings.dataset,
        split="test" if eval else "train", limit=settings.eval_limit if eval else settings.batch_groups,
        offset=offset, group_size=1 if eval else settings.group_size, concurrency=settings.concurrency,
        eval=eval, max_turns=settings.max_turns, temperature=0.0 if eval else settings.temperature,
        max_tokens=settings.max_tokens, progress=True,
    )
    return asyncio.run(run_agents(runner))


def _run_episode_fn(settings: UpSettings, gateway_url: str, admin_key: str, *, eval: bool, offset: int) -> dict[str, Any]:
    """Your own agent (``--agent module:function``) on the JSONL tasks: groups in training, one greedy
    episode per task in evaluation."""
    from agentrl.episodes import load_episode_fn, load_tasks, run_episodes

    if eval:
        tasks = load_tasks(settings.eval_dataset or settings.dataset, limit=settings.eval_limit)
    else:
        tasks = load_tasks(settings.dataset, limit=settings.batch_groups, offset=offset)
    return asyncio.run(run_episodes(
        load_episode_fn(settings.agent), tasks, gateway=gateway_url, key=admin_key,
        group_size=1 if eval else settings.group_size, eval=eval,
        temperature=0.0 if eval else settings.temperature, concurrency=settings.concurrency,
        metadata={"agent": settings.agent, "dataset": settings.dataset}))


def _wait_for_version(procs, gateway_url: str, admin_key: str, version: int, timeout_s: float) -> None:
    """Block until the trainer has pushed weight version ``version`` (the gateway serves it)."""
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {admin_key}"}
    while time.monotonic() < deadline:
        procs.check_alive()
        try:
            r = httpx.get(gateway_url + "/admin/weight_version", headers=headers, timeout=5)
            if r.status_code == 200 and int(r.json()["weight_version"]) >= version:
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.5)
    raise UpFailed(f"the trainer did not reach weight version {version} within {timeout_s:.0f}s; "
                   f"see {procs.log_dir / 'trainer.log'}")


def _write_results(settings: UpSettings, out: Path, steps: list[dict[str, Any]],
                   evals: dict[str, dict[str, Any]], elapsed_s: float) -> dict[str, Any]:
    from agentrl.plot import reward_curve

    checkpoints = sorted((out / "trainer").glob("**/config.json"), key=lambda p: p.stat().st_mtime)
    png = reward_curve(steps, out / "reward_curve.png", evals=evals,
                       title=f"agentrl up: {settings.model}, {settings.dataset}, {settings.agent} agent",
                       custom=":" in settings.agent)
    summary = {
        "model": settings.model, "dataset": settings.dataset, "steps": len(steps),
        "eval_before": _eval_summary(evals["before"], settings.eval_limit),
        "eval_after": _eval_summary(evals["after"], settings.eval_limit),
        "device": settings.device,
        "first_step_reward": steps[0]["mean_reward"], "last_step_reward": steps[-1]["mean_reward"],
        "per_step": steps, "reward_curve": str(png),
        "checkpoint": str(checkpoints[-1].parent) if checkpoints else None,
        "elapsed_s": round(elapsed_s, 1), "out_dir": str(out),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion (``successes`` of ``n``); (0, 1) when n is 0."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4)


def _eval_summary(result: dict[str, Any], limit: int) -> dict[str, Any]:
    """Accuracies of one held-out evaluation, each with its 95% Wilson interval over the prompts evaluated."""
    n = int(result.get("episodes") or limit)
    out: dict[str, Any] = {k: result.get(k) for k in ("accuracy_turn1", "accuracy_final", "mean_reward")}
    out["prompts"] = n
    for key in ("accuracy_turn1", "accuracy_final"):
        if out.get(key) is not None:
            out[key + "_ci95"] = list(wilson_interval(float(out[key]) * n, n))
    return out


def format_summary(summary: dict[str, Any]) -> str:
    lines = [
        "",
        f"agentrl up: {summary['model']} on {summary['dataset']}, {summary['steps']} steps, {summary['elapsed_s']:.0f}s",
        f"  eval before: turn-1 accuracy {summary['eval_before']['accuracy_turn1']}, final {summary['eval_before']['accuracy_final']}",
        f"  eval after:  turn-1 accuracy {summary['eval_after']['accuracy_turn1']}, final {summary['eval_after']['accuracy_final']}",
        f"  eval mean reward: before {summary['eval_before']['mean_reward']}, after {summary['eval_after']['mean_reward']}",
        f"  training reward: step 1 {summary['first_step_reward']:.3f} -> step {summary['steps']} {summary['last_step_reward']:.3f}",
        f"  reward curve: {summary['reward_curve']}",
        f"  checkpoint:   {summary['checkpoint']}",
        f"  summary:      {summary['out_dir']}/summary.json",
    ]
    return "\n".join(lines)
