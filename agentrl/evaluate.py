"""`agentrl eval`: the same agent on the same tasks, base model vs a checkpoint, with a confidence interval.

    agentrl eval --agent my_agent:episode --checkpoint runs/x/trainer/step_000004 --dataset eval.jsonl

Runs your episode function (docs/own-agent.md) greedily (``client.temperature`` is 0) ``--repeats`` times
on every task, first on the base model (``--model``), then on the checkpoint, behind one embedded engine
and gateway: the checkpoint's weights are loaded into the engine between the two (``/update_weights_from_disk``,
so the checkpoint must be of the base model's architecture). Evaluation sessions are recorded, never trained on. Reports each model's mean reward
over the tasks (a task's episodes averaged first) with a 95% interval, and the paired difference
(checkpoint - base, per task) with its own; the difference is significant when its interval excludes 0.
Intervals are 3 digits (agentrl.stats): Wilson's when every task's mean reward is 0 or 1, the normal
approximation otherwise (rewards that are not 0/1, a task's repeats disagreeing, and every difference);
``method`` in ``eval.json`` says which. ``--checkpoint base`` evaluates the base model only. Writes
``eval.json`` in ``--out-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from agentrl.command import add_command, run_command
from agentrl.keys import new_key
from agentrl.settings import SettingsError
from agentrl.stats import mean_ci


@dataclass
class EvalSettings:
    """Settings of `agentrl eval` (env prefix ``AGENTRL_EVAL_``)."""

    env_prefix: ClassVar[str] = "AGENTRL_EVAL_"

    agent: str = field(default="", metadata={"help": "your episode function, module:function (docs/own-agent.md)"})
    checkpoint: str = field(default="", metadata={"help": "a checkpoint directory (HF format, e.g. .../trainer/step_000004), "
                                                          "a trainer directory (its newest checkpoint), or base"})
    dataset: str = field(default="", metadata={"help": "JSONL tasks, one JSON object per line"})
    model: str = field(default="smollm2", metadata={"help": "the base model the checkpoint was trained from"})
    limit: int = field(default=0, metadata={"help": "evaluate only the first N tasks (0 = all)"})
    repeats: int = field(default=1, metadata={"help": "episodes per task (averaged per task; >1 for agents that sample)"})
    temperature: float = field(default=0.0, metadata={"help": "sampling temperature handed to the agent (client.temperature)"})
    concurrency: int = field(default=8, metadata={"help": "episodes running at once"})
    out_dir: str = field(default="", metadata={"help": "logs and eval.json (default runs/eval-<time>)"})
    device: str = field(default="cpu", metadata={"help": "device of the embedded engine", "choices": ("cpu", "cuda")})

    def validate(self) -> None:
        if ":" not in self.agent:
            raise SettingsError("--agent module:function is required (your async episode function)")
        if not self.checkpoint:
            raise SettingsError("--checkpoint DIR (a trainer checkpoint) or --checkpoint base is required")
        if self.checkpoint != "base" and not (Path(self.checkpoint) / "config.json").is_file():
            from trainer.checkpoint import latest

            newest = latest(self.checkpoint)  # a trainer's directory: its newest complete checkpoint
            if newest is None:
                raise SettingsError(f"--checkpoint {self.checkpoint}: neither a checkpoint (no config.json) nor "
                                    "a trainer directory holding one; use e.g. runs/<run>/trainer, or base")
            self.checkpoint = str(newest)
        if not self.dataset or not Path(self.dataset).is_file():
            raise SettingsError(f"--dataset {self.dataset!r}: give a JSONL file of tasks")
        if self.repeats < 1 or self.concurrency < 1 or self.limit < 0:
            raise SettingsError("--repeats and --concurrency must be >= 1, --limit >= 0")
        if not self.out_dir:
            self.out_dir = str(Path("runs") / time.strftime("eval-%Y%m%d-%H%M%S"))


def register(sub: argparse._SubParsersAction) -> None:
    add_command(sub, "eval", EvalSettings, run, description=__doc__,
                help="your agent on your tasks: base model vs a checkpoint, with a 95%% CI")


def run(args: argparse.Namespace) -> int:
    from agentrl.episodes import EpisodeFnError
    from agentrl.procs import ChildFailed

    return run_command("eval", EvalSettings, args, _main,
                       errors={SettingsError: 2, EpisodeFnError: 2, ChildFailed: 1})


def _main(settings: EvalSettings) -> int:
    print(format_report(evaluate(settings)))
    return 0


# ------------------------------------------------------------------------------------------- statistics


def task_means(task_rewards: dict[str, list[float]]) -> dict[str, float]:
    return {task: statistics.fmean(rs) for task, rs in task_rewards.items() if rs}


def compare(base: dict[str, list[float]], after: dict[str, list[float]]) -> dict[str, Any]:
    """Paired by task: the difference of per-task mean rewards (after - base), over tasks both completed."""
    b, a = task_means(base), task_means(after)
    common = sorted(set(b) & set(a))
    diff = mean_ci([a[t] - b[t] for t in common], proportion=False)
    lo_hi = diff["ci95"]
    diff["significant"] = bool(lo_hi and (lo_hi[0] > 0 or lo_hi[1] < 0))
    diff["tasks_compared"] = len(common)
    return diff


# ------------------------------------------------------------------------------------------- running


def evaluate(settings: EvalSettings) -> dict[str, Any]:
    from agentrl.episodes import load_episode_fn, load_tasks

    fn = load_episode_fn(settings.agent)  # fail before starting anything
    tasks = load_tasks(settings.dataset, limit=settings.limit)
    out = Path(settings.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs = {"base": settings.model}
    if settings.checkpoint != "base":
        runs["checkpoint"] = str(Path(settings.checkpoint).resolve())
    results: dict[str, dict[str, Any]] = {}
    with _Stack(settings, out) as stack:
        for name, model in runs.items():
            print(f"[agentrl eval] {name}: {model} on {len(tasks)} tasks x {settings.repeats}", flush=True)
            if name == "checkpoint":
                stack.load_weights(model)
            summary = stack.run(fn, tasks, model)
            rewards = summary.pop("task_rewards")
            results[name] = {"model": model, "reward": mean_ci(list(task_means(rewards).values())),
                             "failed": summary["failed"], "episodes": summary["episodes"], "task_rewards": rewards}
            print(f"[agentrl eval] {name}: mean reward {_num(results[name]['reward']['mean'])} "
                  f"(95% CI {_interval(results[name]['reward'])}), {summary['failed']} failed", flush=True)
    report: dict[str, Any] = {"agent": settings.agent, "dataset": settings.dataset, "tasks": len(tasks),
                              "repeats": settings.repeats, **results, "settings": asdict(settings)}
    if "checkpoint" in results:
        report["difference"] = compare(results["base"]["task_rewards"], results["checkpoint"]["task_rewards"])
    (out / "eval.json").write_text(json.dumps(report, indent=2))
    report["out_dir"] = str(out)
    return report


class _Stack:
    """One embedded engine (serving the base model) and one gateway, stopped on exit."""

    def __init__(self, settings: EvalSettings, out: Path) -> None:
        from agentrl.procs import Processes

        self.settings = settings
        self.out = out
        self.key = new_key("admin")
        self.procs = Processes(out / "logs")

    def __enter__(self) -> _Stack:
        from agentrl.procs import free_port
        from agentrl.stack import gateway_argv, start_engine, start_gateway

        try:
            self.engine_url = start_engine(self.procs, model=self.settings.model, device=self.settings.device,
                                           say=lambda msg: print(f"[agentrl eval] {msg}", flush=True))
            gport = free_port()
            self.url = f"http://127.0.0.1:{gport}"
            start_gateway(self.procs, gateway_argv(engine_url=self.engine_url, port=gport, admin_key=self.key,
                                                   db=f"sqlite+aiosqlite:///{self.out / 'gateway.db'}"), self.url)
        except BaseException:
            self.procs.stop_all()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.procs.stop_all()

    def load_weights(self, checkpoint: str) -> None:
        """The checkpoint's weights into the idle engine (as the trainer's disk push does)."""
        from agentrl.procs import ChildFailed

        import httpx

        r = httpx.post(self.engine_url + "/update_weights_from_disk",
                       json={"model_path": checkpoint, "weight_version": "1"}, timeout=600)
        body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        if r.status_code != 200 or not body.get("success"):
            raise ChildFailed(f"the engine could not load {checkpoint} over {self.settings.model} "
                              f"({body.get('message') or r.text[:300]}); is --model the checkpoint's base model?")

    def run(self, fn: Any, tasks: list[dict[str, Any]], model: str) -> dict[str, Any]:
        from agentrl.episodes import run_episodes

        return asyncio.run(run_episodes(fn, tasks, gateway=self.url, key=self.key, group_size=self.settings.repeats,
                                        eval=True, temperature=self.settings.temperature,
                                        concurrency=self.settings.concurrency,
                                        metadata={"agent": self.settings.agent, "model": model}, progress=True))


def format_report(report: dict[str, Any]) -> str:
    def line(name: str) -> str:
        r = report[name]["reward"]
        return (f"  {name:<10} mean reward {_num(r['mean'])}  95% CI {_interval(r)}  ({report[name]['failed']} failed)  "
                f"{report[name]['model']}")

    lines = ["", f"agentrl eval: {report['agent']} on {report['dataset']} ({report['tasks']} tasks x {report['repeats']})",
             line("base")]
    if "checkpoint" in report:
        d = report["difference"]
        lines += [line("checkpoint"),
                  f"  difference (checkpoint - base, paired by task): {_num(d['mean'])}  95% CI {_interval(d)}  "
                  f"{'significant' if d['significant'] else 'not significant'} over {d['tasks_compared']} tasks"]
    lines.append(f"  report: {report['out_dir']}/eval.json")
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _interval(stat: dict[str, Any]) -> str:
    """``[0.095, 0.373] (Wilson)``; ``n/a`` for fewer than two tasks."""
    if stat.get("ci95") is None:
        return "n/a"
    lo, hi = stat["ci95"]
    return f"[{lo:.3f}, {hi:.3f}] ({'Wilson' if stat['method'] == 'wilson' else 'normal approx.'})"
