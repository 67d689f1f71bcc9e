"""Several `agentrl up` runs side by side: held-out accuracy before/after (95% Wilson intervals), rollout
reward per step, step and push times; one table and one picture.

    python bench/compare_runs.py runs/A runs/B runs/C --out docs/bench/make-run-2026-12-01 \
        --png docs/img/make_run_three.png --title "make run x3, 2 CPU cores"

Reads each run's ``summary.json``, ``settings.json`` and ``trainer/metrics.jsonl``; copies them (renamed
``runN_*``) to ``--out`` with the table as ``runs.md``. Nothing is recomputed from the model: the figures
are what the runs wrote.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path
from typing import Any


def load_run(path: Path) -> dict[str, Any]:
    summary = json.loads((path / "summary.json").read_text())
    settings_file = path / "settings.json"
    metrics_file = path / "trainer" / "metrics.jsonl"
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()] if metrics_file.exists() else []
    return {"path": path, "summary": summary, "metrics": metrics,
            "settings": json.loads(settings_file.read_text()) if settings_file.exists() else {}}


def _interval(ev: dict[str, Any], key: str) -> str:
    low, high = ev.get(f"{key}_ci95") or (float("nan"), float("nan"))
    return f"{ev[key]:.2f} [{low:.2f}, {high:.2f}]"


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def table(runs: list[dict[str, Any]]) -> str:
    lines = ["| run | held-out before (final acc, 95% CI) | after | turn-1 after | rises | rollout reward per step | "
             "trainer step s (median) | push s / paused s (median) | wall s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i, run in enumerate(runs, 1):
        s, m = run["summary"], run["metrics"]
        before, after = s["eval_before"], s["eval_after"]
        rewards = ", ".join(f"{p['mean_reward']:.3f}" for p in s.get("per_step", []))
        step_s = _median([r["perf/step_s"] for r in m if "perf/step_s" in r])
        push_s = _median([r["sync/seconds"] for r in m if "sync/seconds" in r])
        paused = _median([r["sync/paused_s"] for r in m if "sync/paused_s" in r])
        rises = "yes" if after["accuracy_final"] > before["accuracy_final"] else "no"
        lines.append(f"| {i} (`{run['path'].name}`) | {_interval(before, 'accuracy_final')} | "
                     f"{_interval(after, 'accuracy_final')} | {after['accuracy_turn1']:.2f} | {rises} | {rewards} | "
                     f"{step_s:.1f} | {push_s:.2f} / {paused:.2f} | {s['elapsed_s']:.0f} |")
    prompts = {r["summary"]["eval_before"]["prompts"] for r in runs}
    rose = sum(r["summary"]["eval_after"]["accuracy_final"] > r["summary"]["eval_before"]["accuracy_final"] for r in runs)
    lines.append("")
    lines.append(f"Held-out accuracy rose in {rose} of {len(runs)} runs ({', '.join(map(str, sorted(prompts)))} prompts each).")
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    for i, run in enumerate(runs, 1):
        steps = run["summary"].get("per_step", [])
        xs_steps = [p["step"] + 1 for p in steps]  # summary steps count from 0; the log and the docs from 1
        left.plot(xs_steps, [p["mean_reward"] for p in steps], "o-", label=f"run {i}")
        left.set_xticks(xs_steps)
        b, a = run["summary"]["eval_before"], run["summary"]["eval_after"]
        xs = [i - 0.12, i + 0.12]
        ys = [b["accuracy_final"], a["accuracy_final"]]
        lows = [y - ci[0] for y, ci in zip(ys, (b["accuracy_final_ci95"], a["accuracy_final_ci95"]))]
        highs = [ci[1] - y for y, ci in zip(ys, (b["accuracy_final_ci95"], a["accuracy_final_ci95"]))]
        right.errorbar(xs, ys, yerr=[lows, highs], fmt="none", ecolor="grey", capsize=4)
        right.plot(xs[0], ys[0], "o", color="tab:grey", label="before" if i == 1 else None)
        right.plot(xs[1], ys[1], "s", color="tab:green", label="after" if i == 1 else None)
        right.plot(xs, ys, "-", color="tab:green", alpha=0.4)
    left.set_xlabel("training step")
    left.set_ylabel("mean reward of the step's rollouts")
    left.set_ylim(-0.02, 1.02)
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    left.set_title("rollout reward")
    right.set_xticks(range(1, len(runs) + 1), [f"run {i}" for i in range(1, len(runs) + 1)])
    right.set_ylabel("held-out greedy accuracy (95% Wilson)")
    right.set_ylim(-0.02, 1.02)
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    right.set_title("held-out accuracy before -> after")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run folders written by `agentrl up`")
    ap.add_argument("--out", type=Path, help="copy the runs' JSON files and the table here")
    ap.add_argument("--png", type=Path, help="write the picture here")
    ap.add_argument("--title", default="agentrl up runs")
    args = ap.parse_args(argv)
    runs = [load_run(p) for p in args.runs]
    text = table(runs)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        for i, run in enumerate(runs, 1):
            for name in ("summary.json", "settings.json", "trainer/metrics.jsonl"):
                src = run["path"] / name
                if src.exists():
                    shutil.copyfile(src, args.out / f"run{i}_{Path(name).name}")
        (args.out / "runs.md").write_text(text + "\n")
    if args.png:
        plot(runs, args.png, args.title)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
