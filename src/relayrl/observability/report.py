"""A Markdown run report with plots, built only from a run directory's own files.

Works on a finished run and on an interrupted one: every section uses what is there
(``summary.json``, ``metrics.jsonl``, ``trace.json``) and says what is missing.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from relayrl.observability.plots import read_jsonl  # noqa: E402


def write_report(run_dir: Path) -> Path:
    """Write ``RUN_DIR/report.md`` (plots under ``RUN_DIR/report/``) and return its path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory '{run_dir}' does not exist")
    summary = _read_json(run_dir / "summary.json")
    metrics = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    trace = _read_json(run_dir / "trace.json")
    figures = run_dir / "report"
    figures.mkdir(exist_ok=True)

    lines = [f"# relayrl run report: {run_dir.name}", ""]
    status = summary.get("status", "unknown (no summary.json)")
    lines += [f"- status: **{status}**", f"- mode: {summary.get('mode', '?')}"]
    if "error" in summary:
        lines.append(f"- error: `{summary['error']}`")
    steps = summary.get("steps") or (metrics[-1]["step"] if metrics else 0)
    lines += [f"- RL steps: {steps}", ""]

    lines += ["## Evaluation", ""] + _eval_table(summary, metrics) + [""]
    lines += ["## Learning curves", ""]
    lines += _figure(_plot_curves(metrics, figures / "curves.png"), "reward and accuracy")
    lines += ["## Throughput", ""]
    lines += _figure(_plot_throughput(metrics, figures / "throughput.png"), "samples per second")
    lines += ["## Busy fractions", ""]
    busy = summary.get("perf", {}).get("busy") or trace.get("otherData", {}).get("busy", {})
    lines += _figure(_plot_bars(busy, "busy fraction", figures / "busy.png"), "busy fractions")
    if (run_dir / "timeline.png").is_file():
        lines += ["![timeline](timeline.png)", ""]
    lines += ["## Policy lag", ""]
    hist = {int(k): v for k, v in summary.get("staleness", {}).get("hist", {}).items()}
    lines += _figure(_plot_bars(hist, "samples", figures / "lag.png"), "lag histogram")
    lines += ["## Off-policy health", ""]
    lines += _figure(_plot_health(metrics, figures / "health.png"), "off-policy health metrics")
    lines += _health_table(metrics)
    lines += ["## Weight sync", ""]
    lines += _figure(_plot_sync(trace, figures / "sync.png"), "weight-sync durations")
    if summary.get("samples"):
        lines += ["## Samples", "", "| count | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in summary["samples"].items()] + [""]
    out = run_dir / "report.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _eval_table(summary: dict, metrics: list[dict]) -> list[str]:
    evals = summary.get("eval", {})
    if evals:
        rows = ["| when | accuracy | n | policy version |", "|---|---|---|---|"]
        for when, e in evals.items():
            rows.append(f"| {when} | {e['accuracy']:.3f} | {e['n']} | {e.get('version', '?')} |")
        return rows
    points = [(m["step"], m["eval/accuracy"]) for m in metrics if "eval/accuracy" in m]
    if not points:
        return ["No evaluation recorded (the run stopped before its first evaluation)."]
    return ["| step | accuracy |", "|---|---|"] + [f"| {s} | {a:.3f} |" for s, a in points]


def _figure(path: Path | None, what: str) -> list[str]:
    if path is None:
        return [f"No data for {what} in this run.", ""]
    return [f"![{what}](report/{path.name})", ""]


def _plot_curves(metrics: list[dict], out: Path) -> Path | None:
    rows = [m for m in metrics if "rollout/accuracy" in m]
    evals = [(m["step"], m["eval/accuracy"]) for m in metrics if "eval/accuracy" in m]
    if not rows and not evals:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    if rows:
        steps = [m["step"] for m in rows]
        ax.plot(steps, [m["rollout/accuracy"] for m in rows], label="rollout accuracy")
        ax.plot(steps, [m["rollout/reward_mean"] for m in rows], label="reward", alpha=0.6)
    if evals:
        ax.plot(*zip(*evals, strict=True), "o--", label="held-out accuracy")
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out)


# The trainer's per-step health metrics of its importance weights r = pi / mu (see
# relayrl.algorithms.losses), plotted in this order.
HEALTH = (
    ("loss/ess", "ESS (normalised)"),
    ("loss/clip_frac", "truncated / masked / clipped"),
    ("loss/log_ratio_p99", "p99 |log r|"),
    ("loss/log_ratio_max", "max |log r|"),
    ("loss/kl_mu_pi", "KL(mu || pi)"),
    ("loss/grad_norm", "gradient norm"),
)


def _plot_health(metrics: list[dict], out: Path) -> Path | None:
    shown = [(key, label) for key, label in HEALTH if any(key in m for m in metrics)]
    if not shown:
        return None
    fig, _ = plt.subplots(len(shown), 1, figsize=(7, 1.6 * len(shown)), sharex=True)
    for ax, (key, label) in zip(list(fig.axes), shown, strict=True):
        rows = [m for m in metrics if key in m]
        ax.plot([m["step"] for m in rows], [m[key] for m in rows])
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes = list(fig.axes)
    axes[-1].set_xlabel("RL step")
    return _save(fig, out)


def _health_table(metrics: list[dict]) -> list[str]:
    rows = []
    for key, label in HEALTH:
        values = [m[key] for m in metrics if key in m]
        if values:
            low, high = min(values), max(values)
            rows.append(f"| {label} | {values[-1]:.4g} | {low:.4g} | {high:.4g} |")
    if not rows:
        return []
    return ["| metric | last | min | max |", "|---|---|---|---|", *rows, ""]


def _plot_throughput(metrics: list[dict], out: Path) -> Path | None:
    rows = [m for m in metrics if "perf/samples_per_s" in m]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot([m["step"] for m in rows], [m["perf/samples_per_s"] for m in rows])
    ax.set_xlabel("RL step")
    ax.set_ylabel("trained samples / s")
    ax.grid(alpha=0.3)
    return _save(fig, out)


def _plot_bars(values: dict, ylabel: str, out: Path) -> Path | None:
    if not values:
        return None
    fig, ax = plt.subplots(figsize=(5, 3))
    keys = sorted(values)
    ax.bar([str(k) for k in keys], [values[k] for k in keys])
    ax.set_ylabel(ylabel)
    return _save(fig, out)


def _plot_sync(trace: dict, out: Path) -> Path | None:
    durations: dict[str, list[float]] = {}
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "X" and event["name"] in ("publish", "update_weights"):
            durations.setdefault(event["name"], []).append(event["dur"] / 1e3)
    if not durations:
        return None
    fig, ax = plt.subplots(figsize=(6, 3))
    for name, values in durations.items():
        ax.hist(values, bins=40, alpha=0.6, label=f"{name} (n={len(values)})")
    ax.set_xlabel("milliseconds")
    ax.legend()
    return _save(fig, out)


def _save(fig, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
