"""`agentrl eval`: the same agent on the same tasks, base model vs a checkpoint, with a confidence interval.

    agentrl eval --agent my_agent:episode --checkpoint runs/x/trainer/step_000004 --dataset eval.jsonl

Runs your episode function (docs/own-agent.md) greedily (``client.temperature`` is 0) ``--repeats`` times
on every task, first on the base model (``--model``), then on the checkpoint, behind one embedded engine
and gateway: the checkpoint's weights are loaded into the engine between the two (``/update_weights_from_disk``,
so the checkpoint must be of the base model's architecture). Evaluation sessions are recorded, never trained on. Reports each model's mean reward
with a 95% confidence interval and the paired difference (checkpoint - base, per task) with its own; the
difference is significant when its interval excludes 0. ``--checkpoint base`` evaluates the base model only.
Writes ``eval.json`` in ``--out-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import secrets
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from agentrl.settings import SettingsError, add_arguments, load

Z95 = 1.959964  # two-sided 95% normal quantile


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
    parser = sub.add_parser("eval", help="your agent on your tasks: base model vs a checkpoint, with a 95%% CI",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, EvalSettings)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agentrl.episodes import EpisodeFnError
    from agentrl.procs import ChildFailed

    try:
        settings = load(EvalSettings, args)
        report = evaluate(settings)
    except (SettingsError, EpisodeFnError) as exc:
        print(f"agentrl eval: {exc}", file=sys.stderr)
        return 2
    except ChildFailed as exc:
        print(f"agentrl eval: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nagentrl eval: interrupted; every process it started has been stopped", file=sys.stderr)
        return 130
    print(format_report(report))
    return 0


# ------------------------------------------------------------------------------------------- statistics


def mean_ci(values: list[float]) -> dict[str, Any]:
    """Mean and 95% normal-approximation interval of ``values`` (the interval is None for fewer than 2)."""
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "ci95": None}
    mean = statistics.fmean(values)
    if n < 2:
        return {"n": n, "mean": mean, "ci95": None}
    half = Z95 * statistics.stdev(values) / math.sqrt(n)
    return {"n": n, "mean": round(mean, 6), "ci95": [round(mean - half, 6), round(mean + half, 6)]}


def task_means(task_rewards: dict[str, list[float]]) -> dict[str, float]:
    return {task: statistics.fmean(rs) for task, rs in task_rewards.items() if rs}


def compare(base: dict[str, list[float]], after: dict[str, list[float]]) -> dict[str, Any]:
    """Paired by task: the difference of per-task mean rewards (after - base), over tasks both completed."""
    b, a = task_means(base), task_means(after)
    common = sorted(set(b) & set(a))
    diff = mean_ci([a[t] - b[t] for t in common])
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
            print(f"[agentrl eval] {name}: mean reward {results[name]['reward']['mean']} "
                  f"(95% CI {results[name]['reward']['ci95']}), {summary['failed']} failed", flush=True)
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
        self.key = secrets.token_urlsafe(16)
        self.procs = Processes(out / "logs")

    def __enter__(self) -> _Stack:
        from agentrl.up import _free_port

        eport, gport = _free_port(), _free_port()
        self.engine_url, self.url = f"http://127.0.0.1:{eport}", f"http://127.0.0.1:{gport}"
        try:
            engine = self.procs.start_agentrl("engine", ["engine", "--model", self.settings.model, "--port",
                                                         str(eport), "--device", self.settings.device])
            self.procs.wait_healthy(engine, self.engine_url + "/health", timeout_s=600)
            gateway = self.procs.start_agentrl("gateway", [
                "gateway", "--engine-url", self.engine_url, "--port", str(gport), "--admin-key", self.key,
                "--db", f"sqlite+aiosqlite:///{self.out / 'gateway.db'}"])
            self.procs.wait_healthy(gateway, self.url + "/health", timeout_s=300)
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
                                        metadata={"agent": self.settings.agent, "model": model}))


def format_report(report: dict[str, Any]) -> str:
    def line(name: str) -> str:
        r = report[name]["reward"]
        return f"  {name:<10} mean reward {r['mean']}  95% CI {r['ci95']}  ({report[name]['failed']} failed)  {report[name]['model']}"

    lines = ["", f"agentrl eval: {report['agent']} on {report['dataset']} ({report['tasks']} tasks x {report['repeats']})",
             line("base")]
    if "checkpoint" in report:
        d = report["difference"]
        lines += [line("checkpoint"),
                  f"  difference (checkpoint - base, paired by task): {d['mean']}  95% CI {d['ci95']}  "
                  f"{'significant' if d['significant'] else 'not significant'} over {d['tasks_compared']} tasks"]
    lines.append(f"  report: {report['out_dir']}/eval.json")
    return "\n".join(lines)
