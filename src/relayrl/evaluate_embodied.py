"""`relayrl eval` on an embodied run: play a checkpoint's VLA policy in its run's simulator and
report success per task.

It runs the run's own evaluator (``relayrl.executors.evaluator``) in this process, under the
run's protocol (``EvalProtocol``): the same tasks, episodes, seeds and action choice as the run's
in-run evaluations, so ``relayrl eval RUN`` on a run's final checkpoint reports what its final
evaluation did, task by task. Options change the protocol: ``--seed`` (default the run's
``run.seed``), ``--episodes`` per task (default ``env.eval_episodes`` split over the tasks),
``--tasks``, ``--greedy`` / ``--sample`` (default ``env.eval_greedy``) and ``--protocol``:

- ``libero`` (LIBERO's own evaluation, as OpenVLA runs it; the default for LIBERO runs): episode
  i of a task starts from the task's benchmark init state i, the robot first holds still for the
  env's wait steps (10; not counted), and each suite has its step cap (spatial 220, object 280,
  goal 300, libero_10 520), whatever ``env.max_steps`` the run trained with. OpenVLA's numbers
  are ``--episodes 50``.
- ``seeded`` (every other env): episode i of a task is ``reset(task, seed=S + i)`` with the
  env's own episode limit, so two checkpoints meet the same episodes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from safetensors.torch import load_file
from tqdm import tqdm

from relayrl.config import Config, load_config
from relayrl.executors.evaluator import (
    PROTOCOLS,
    SEED_STRIDE,
    EvalProtocol,
    Evaluator,
    Outcome,
    eval_env,
    protocol_name,
)
from relayrl.models.vla import saved_vla_config

__all__ = ["PROTOCOLS", "SEED_STRIDE", "embodied_run", "evaluate_embodied"]


def embodied_run(path: Path) -> tuple[Config, Path] | None:
    """The config and checkpoint folder of an embodied run directory (or of the checkpoint
    folder inside one); None when ``path`` is not one."""
    for run_dir, ckpt in ((path, path / "checkpoint"), (path.parent, path)):
        if (run_dir / "config.yaml").is_file() and (ckpt / "vla_config.json").is_file():
            cfg = load_config(run_dir / "config.yaml", [])
            if cfg.workload == "embodied":
                return cfg, ckpt
    return None


def evaluate_embodied(
    cfg: Config,
    checkpoint: Path,
    *,
    protocol: str | None = None,
    episodes: int | None = None,
    tasks: list[str] | None = None,
    greedy: bool | None = None,
    seed: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Play the run's evaluation protocol (changed by the arguments given: see the module
    docstring) with the policy in ``checkpoint``; returns the report (per-task success, steps
    and the episodes' init states or seeds)."""
    vla = saved_vla_config(checkpoint)
    policy = {"version": None, "weights": load_file(str(checkpoint / "model.safetensors"))}
    name = protocol_name(cfg, protocol)
    player = Evaluator(eval_env(cfg, name, 0), vla, cfg.ray.threads_per_executor)
    try:
        # A LIBERO run's env.tasks narrows its suite, as the run's own placement does.
        narrowed = cfg.env.name == "libero" and cfg.env.tasks
        env_tasks = list(cfg.env.tasks) if narrowed else list(player.env.tasks)
        plan = EvalProtocol.of(
            cfg, env_tasks, seed=seed, greedy=greedy, tasks=tasks, episodes=episodes, name=name
        )
        report: dict[str, Any] = {
            "checkpoint": str(checkpoint),
            "env": cfg.env.name,
            "max_steps": getattr(player.env, "max_steps", None),
        }
        if plan.name == "libero":
            report |= {"suite": player.env.suite, "wait_steps": player.env.settle_steps}
        start, outcomes = time.time(), []
        planned = plan.plan()
        bar = tqdm(total=len(planned), desc="eval", unit="ep", disable=not progress)
        player.play([], plan.greedy, policy)
        for episode in planned:
            outcomes += player.play([episode], plan.greedy)
            bar.update(1)
            bar.set_postfix(task=episode.task[:24], success=f"{_rate(outcomes):.2f}", refresh=False)
        bar.close()
    finally:
        player.close()
    found = report | plan.report(outcomes)
    for task, row in found["tasks"].items():
        mine = [e for e in planned if e.task == task]
        if plan.name == "libero":
            row["init_states"] = [e.init_state for e in mine]
        else:
            row["seeds"] = [e.seed for e in mine]
    return found | {"time_s": time.time() - start}


def _rate(outcomes: list[Outcome]) -> float:
    return sum(o.success for o in outcomes) / len(outcomes)


def format_report(report: dict) -> str:
    """The report as text: one line per task, then the mean."""
    head = f"protocol {report['protocol']}, env {report['env']}"
    if report["protocol"] == "libero":
        head += (
            f" ({report['suite']}: {report['wait_steps']} wait steps, cap {report['max_steps']})"
        )
    lines = [head + (", greedy" if report["greedy"] else ", sampled")]
    width = max(len(t) for t in report["tasks"])
    for task, row in report["tasks"].items():
        lines.append(
            f"  {task:<{width}}  {row['success_rate']:.3f}  "
            f"({row['successes']}/{row['episodes']}, {row['mean_steps']:.1f} steps)"
        )
    lines.append(
        f"success {report['success_rate']:.3f} over {len(report['tasks'])} tasks, "
        f"{report['episodes']} episodes, {report['time_s']:.1f} s"
    )
    return "\n".join(lines)


def write_report(report: dict, path: Path) -> Path:
    """Write ``report`` as JSON to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    return path
