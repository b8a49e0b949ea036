"""Render docs/benchmarks.md's tables from the result JSON.

Each table the script owns sits between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->`` in
the doc, and ``TABLES[NAME]`` renders it from its result file. Without options the script says
which tables differ from their rendering (exit status 1 if any); ``--write`` rewrites them.

    python benchmarks/render_tables.py            # check
    python benchmarks/render_tables.py --write    # update docs/benchmarks.md

Only standard-library imports, so tests can call it without Ray or torch.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "benchmarks.md"


def _row(*cells: object) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def _rule(columns: int) -> str:
    return "|" + "---|" * columns


def tracing_overhead(result: dict) -> str:
    """Per mode: step time, spans and waits per step, the tracing cost per step and its share of
    the step, and the end-of-run trace write and its share of the RL wall clock."""
    lines = [
        "| mode | step time (s) | spans/step | waits/step | tracing per step | % of step time "
        "| end-of-run trace (s) | % of RL wall-clock |",
        _rule(8),
    ]
    for run in result["runs"]:
        lines.append(
            _row(
                run["mode"],
                f"{run['step_time_s']:.4f}",
                f"{run['busy_spans_per_step']:.1f}",
                f"{run['waits_per_step']:.1f}",
                f"{run['overhead_s_per_step'] * 1e6:.1f} µs",
                f"{run['overhead_fraction'] * 100:.4f}%",
                f"{run['trace_write_s']:.2f}",
                f"{run['trace_write_s'] / run['rl_wall_clock_s'] * 100:.2f}%",
            )
        )
    return "\n".join(lines)


MATH_SETTINGS = {
    "in-process": "in the calling process (no sandbox)",
    "1 worker": "`ScoringPool`, 1 worker",
    "2 workers": "`ScoringPool`, 2 workers",
}


def math_scoring(result: dict) -> str:
    """Per setting: pairs scored per second, and the pool's timeouts and errors."""
    lines = ["| setting | pairs/s | timeouts | errors |", _rule(4)]
    for run in result["runs"]:
        counters = run["counters"] or {}
        lines.append(
            _row(
                MATH_SETTINGS.get(run["setting"], run["setting"]),
                f"{run['pairs_per_s']:.0f}",
                counters.get("timeouts", "–"),
                counters.get("errors", "–"),
            )
        )
    return "\n".join(lines)


def _held_out(label: str, run: dict, *extra: str) -> str:
    start, end = 100 * run["start_accuracy"], 100 * run["final_accuracy"]
    return _row(label, f"{start:.1f}", f"{end:.1f}", f"{end - start:+.1f}", *extra)


def ppo_vs_grpo(result: dict) -> str:
    """GRPO against PPO with the critic: held-out accuracy at the start and end, and wall clock."""
    runs = result["runs"]
    return "\n".join(
        [
            "| variant | held-out start | held-out end | gain (points) | wall clock |",
            _rule(5),
            _held_out("GRPO (aipo)", runs["grpo"], f"{runs['grpo']['wall_clock_s'] / 60:.1f} min"),
            _held_out(
                "PPO with the critic (ppo_clip, GAE)",
                runs["ppo"],
                f"{runs['ppo']['wall_clock_s'] / 60:.1f} min",
            ),
        ]
    )


def reward_model(result: dict) -> str:
    """The rule reward against the reward model's score alone: held-out accuracy."""
    runs = result["runs"]
    return "\n".join(
        [
            "| reward | held-out start | held-out end | gain (points) |",
            _rule(4),
            _held_out("rule", runs["rule"]),
            _held_out("reward model alone", runs["reward_model"]),
        ]
    )


def acce_g1(result: dict) -> str:
    """G.1: per value-recomputation arm and seed, success, lag, env steps, time and the books."""
    lines = [
        "| value_recompute | seed | final held-out success | training success (last 10 steps) "
        "| mean lag | trained env steps | RL wall clock (s) | books balance |",
        _rule(8),
    ]
    for run in result["runs"]:
        lines.append(
            _row(
                run["arm"],
                run["seed"],
                f"{run['final_success']:.3f}",
                f"{run['rollout_success_last10']:.3f}",
                f"{run['staleness_mean']:.2f}",
                run["trained_env_steps"],
                f"{run['rl_wall_clock_s']:.0f}",
                run["accounted"],
            )
        )
    return "\n".join(lines)


def acce_g2(result: dict) -> str:
    """G.2: per loss, forced lag and seed, success, the loss's clipped share and ESS, lag, env
    steps, stale drops, time and the books."""
    lines = [
        "| loss | forced lag | seed | final held-out success | training success (last 10 steps) "
        "| clipped / down-weighted | ESS | mean lag | trained env steps | stale drops "
        "| RL wall clock (s) | books balance |",
        _rule(12),
    ]
    for run in result["runs"]:
        loss, _, lag = run["arm"].partition(" lag ")
        lines.append(
            _row(
                loss,
                lag,
                run["seed"],
                f"{run['final_success']:.3f}",
                f"{run['rollout_success_last10']:.3f}",
                f"{run['clip_frac_mean']:.3f}",
                f"{run['ess_mean']:.3f}",
                f"{run['staleness_mean']:.2f}",
                run["trained_env_steps"],
                run["dropped_stale"],
                f"{run['rl_wall_clock_s']:.0f}",
                run["accounted"],
            )
        )
    return "\n".join(lines)


# name: (result file, renderer)
TABLES: dict[str, tuple[str, Callable[[dict], str]]] = {
    "tracing_overhead": ("benchmarks/results/tracing_overhead.json", tracing_overhead),
    "math_scoring": ("benchmarks/results/math_scoring.json", math_scoring),
    "ppo_vs_grpo": ("experiments/results/ppo_vs_grpo.json", ppo_vs_grpo),
    "reward_model": ("experiments/results/reward_model.json", reward_model),
    "acce_g1": ("experiments/results/acce_ablations_g1.json", acce_g1),
    "acce_g2": ("experiments/results/acce_ablations_g2.json", acce_g2),
}


def block(name: str) -> re.Pattern:
    """The marked block of table ``name`` in the doc; group 1 is the table."""
    return re.compile(rf"<!-- table:{name} -->\n(.*?)\n<!-- /table:{name} -->", re.S)


def render(name: str) -> str:
    """Table ``name`` rendered from its result file."""
    path, renderer = TABLES[name]
    return renderer(json.loads((REPO / path).read_text()))


def in_doc(text: str, name: str) -> str | None:
    """Table ``name`` as the doc holds it, or None if the doc lacks its markers."""
    found = block(name).search(text)
    return found[1] if found else None


def main(argv: list[str] | None = None) -> int:
    """Check the doc's tables against their rendering, or rewrite them with ``--write``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the doc's tables")
    args = parser.parse_args(argv)
    text, stale = DOC.read_text(), []
    for name in TABLES:
        table = render(name)
        if in_doc(text, name) is None:
            stale.append(f"{name}: no markers in {DOC.relative_to(REPO)}")
        elif in_doc(text, name) != table:
            stale.append(f"{name}: differs from {TABLES[name][0]}")
            text = block(name).sub(
                lambda _, n=name, t=table: f"<!-- table:{n} -->\n{t}\n<!-- /table:{n} -->", text
            )
    if args.write:
        DOC.write_text(text)
    print("\n".join(stale) or "every table equals its rendering")
    return 1 if stale and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
