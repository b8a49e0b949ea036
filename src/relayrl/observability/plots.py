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


def plot_learning_curve(
    metrics_path: Path, out_png: Path, eval_label: str = "held-out accuracy (greedy)"
) -> Path:
    """Sampled rollout accuracy per RL step, and the evaluations logged in between (legend
    ``eval_label``)."""
    rows = read_jsonl(metrics_path)
    records = [r for r in rows if "rollout/accuracy" in r]
    evals = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    fig, ax = plt.subplots(figsize=(7, 4))
    if records:
        steps = [r["step"] for r in records]
        ax.plot(steps, [r["rollout/accuracy"] for r in records], label="rollout accuracy (sampled)")
    if evals:
        ax.plot(list(evals), list(evals.values()), "o--", label=eval_label)
    ax.set_xlabel("RL step (policy version)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


PHASE_COLORS = {
    "generate": "tab:blue",
    "score": "tab:green",
    "train_step": "tab:red",
    "publish": "tab:purple",
    "update_weights": "tab:purple",
}


def plot_timeline(
    spans: dict[str, tuple[list, list]],
    out_png: Path,
    window: tuple[float, float],
    busy: dict[str, float],
) -> Path:
    """Each executor's busy spans (coloured by phase) and waits (grey) inside ``window``."""
    start, end = window
    names = sorted(spans)
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.8 * len(names)))
    for row, name in enumerate(names):
        busy_spans, waits = spans[name]
        for kind, items, height in (("wait", waits, 0.3), ("busy", busy_spans, 0.6)):
            bars: dict[str, list[tuple[float, float]]] = {}
            for s in items:
                if s.end < start or s.start > end:
                    continue
                color = "0.8" if kind == "wait" else PHASE_COLORS.get(s.name, "tab:gray")
                left = max(s.start, start) - start
                bars.setdefault(color, []).append((left, min(s.end, end) - max(s.start, start)))
            for color, xranges in bars.items():
                ax.broken_barh(xranges, (row - height / 2, height), color=color)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([f"{n}\nbusy {busy.get(n, 0.0):.0%}" for n in names])
    ax.set_xlim(0, end - start)
    ax.set_xlabel("seconds (a window in the middle of RL; busy % over the whole RL phase)")
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:blue", "tab:green", "tab:red", "0.8")
    ]
    ax.legend(
        handles,
        ["generate", "score", "train step", "wait / idle"],
        loc="upper right",
        ncol=4,
        fontsize=8,
    )
    ax.set_ylim(-0.6, len(names) - 0.4 + 0.5)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
