"""The reward-curve PNG that `agentrl up` writes: per training step, mean reward, and accuracy where the
agent reports one (the example agents do; an episode function has only rewards)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _values(steps: list[dict[str, Any]], key: str) -> list[float]:
    return [float("nan") if s.get(key) is None else float(s[key]) for s in steps]


def reward_curve(steps: list[dict[str, Any]], path: Path, *, title: str,
                 evals: dict[str, dict[str, Any]] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [s["step"] for s in steps]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(xs, _values(steps, "mean_reward"), "o-", linewidth=2.5, alpha=0.6,
            label="mean episode reward (training rollouts)")
    for key, style, label in (("accuracy_turn1", "s--", "turn-1 accuracy"),
                              ("accuracy_final", "^--", "final accuracy (after retries)")):
        if any(key in s for s in steps):
            ax.plot(xs, _values(steps, key), style, label=label)
    for name, style in (("before", ":"), ("after", "-.")):
        if evals and name in evals:
            reported = evals[name].get("accuracy_final") is not None
            key, what = ("accuracy_final", "final acc") if reported else ("mean_reward", "mean reward")
            acc = evals[name].get(key) or 0.0
            ax.axhline(acc, color="grey", linestyle=style, linewidth=1, label=f"eval {name} training ({what}): {acc:.2f}")
    ax.set_xlabel("training step (rollouts under weight version = step)")
    ax.set_xticks(xs)
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
