"""Plots rendered from a run's own files."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_jsonl(path: Path) -> list[dict]:
    """All records of a JSONL file (a torn last line from an interrupted run is skipped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def plot_learning_curve(metrics_path: Path, out_png: Path, evals: dict[int, float]) -> Path:
    """Training accuracy and reward per RL step, with held-out accuracy at the given steps."""
    records = [r for r in read_jsonl(metrics_path) if "rollout/accuracy" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if records:
        steps = [r["step"] for r in records]
        ax.plot(steps, [r["rollout/accuracy"] for r in records], label="rollout accuracy (sampled)")
    if evals:
        ax.plot(list(evals), list(evals.values()), "o--", label="held-out accuracy (greedy)")
    ax.set_xlabel("RL step (policy version)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
