"""The reward-curve PNG that `agentrl up` writes: per training step, mean reward and accuracy."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def reward_curve(steps: list[dict[str, Any]], path: Path, *, title: str, evals: dict[str, dict[str, Any]] | None = None,
                 custom: bool = False) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [s["step"] for s in steps]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(xs, [s["mean_reward"] for s in steps], "o-", linewidth=2.5, alpha=0.6, label="mean reward (training rollouts)")
    if not custom:  # the example agents' accuracies; your own agent has only rewards
        ax.plot(xs, [s["turn1_accuracy"] for s in steps], "s--", label="turn-1 accuracy")
        ax.plot(xs, [s["final_accuracy"] for s in steps], "^--", label="final accuracy (after retries)")
    for name, style in (("before", ":"), ("after", "-.")):
        if evals and name in evals:
            key, what = ("mean_reward", "mean reward") if custom else ("accuracy_final", "final acc")
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
