"""`relayrl eval` on an embodied run: play a checkpoint's VLA policy in its run's simulator and
report success per task.

Two protocols:

- ``libero`` (LIBERO's own evaluation, as OpenVLA runs it): episode i of a task starts from the
  task's benchmark init state i (the same 50 states for every checkpoint), the robot first holds
  still for the env's wait steps (10; not counted), and each suite has its step cap (spatial 220,
  object 280, goal 300, libero_10 520), whatever ``env.max_steps`` the run trained with.
- ``seeded`` (every other env): episode i of a task is ``reset(task, seed=S + i)`` with the
  env's own episode limit, so two checkpoints meet the same episodes.

Actions are chosen as the run's own evaluations chose them (``env.eval_greedy``) unless
``--greedy`` or ``--sample`` says otherwise; sampled ones come from a seeded generator. The env is
the run's, without its simulated latency; an instruction-blind run is evaluated blind.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from relayrl.config import Config, load_config
from relayrl.envs.embodied import EmbodiedEnv
from relayrl.executors.worker_side import build_env
from relayrl.wm.collect import play_episode
from relayrl.wm.policies import CheckpointPolicy

PROTOCOLS = ("libero", "seeded")
SEED_STRIDE = 100_003  # episode seeds of different --seed values never meet


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
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Play ``episodes`` per task (default: 50 under libero, ``env.eval_episodes`` otherwise) of
    ``tasks`` (default ``env.eval_tasks``, else ``env.tasks``, else every task of the env) with
    the policy in ``checkpoint``; returns the report (per-task success, steps and the episodes'
    init states or seeds). ``greedy`` None: as ``env.eval_greedy``."""
    greedy = cfg.env.eval_greedy if greedy is None else greedy
    protocol = protocol or ("libero" if cfg.env.name == "libero" else "seeded")
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {list(PROTOCOLS)}, got {protocol!r}")
    if protocol == "libero" and cfg.env.name != "libero":
        raise ValueError(
            f"protocol 'libero' needs env.name=libero; this run's env is {cfg.env.name!r}"
        )
    if episodes is not None and episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    env_cfg = cfg.env.model_copy(update={"latency": "none"})
    if protocol == "libero":  # the suite's own step cap
        env_cfg = env_cfg.model_copy(update={"max_steps": None})
    env = build_env(env_cfg, seed)
    try:
        chosen = _tasks(env, tasks or cfg.env.eval_tasks or cfg.env.tasks)
        if episodes is None:
            episodes = 50 if protocol == "libero" else cfg.env.eval_episodes
        if protocol == "libero":
            for task in chosen:
                if episodes > (have := env.init_states(task)):
                    raise ValueError(
                        f"episodes must be <= {have} under the libero protocol (task {task!r} "
                        f"has {have} init states), got {episodes}"
                    )
        actor = CheckpointPolicy(checkpoint, seed, greedy=greedy)
        report: dict[str, Any] = {
            "checkpoint": str(checkpoint),
            "env": cfg.env.name,
            "protocol": protocol,
            "greedy": greedy,
            "seed": seed,
            "max_steps": getattr(env, "max_steps", None),
        }
        if protocol == "libero":
            report |= {"suite": env.suite, "wait_steps": env.settle_steps}
        start, per_task = time.time(), {}
        bar = tqdm(total=episodes * len(chosen), desc="eval", unit="ep", disable=not progress)
        for task in chosen:
            results = []
            for i in range(episodes):
                options = {"init_state": i} if protocol == "libero" else {}
                played = play_episode(env, actor, task=task, seed=seed * SEED_STRIDE + i, **options)
                results.append((played.success, len(played.actions)))
                bar.update(1)
                bar.set_postfix(task=task[:24], success=f"{_rate(results):.2f}", refresh=False)
            per_task[task] = {
                "episodes": episodes,
                "successes": sum(ok for ok, _ in results),
                "success_rate": _rate(results),
                "mean_steps": sum(steps for _, steps in results) / episodes,
                ("init_states" if protocol == "libero" else "seeds"): [
                    i if protocol == "libero" else seed * SEED_STRIDE + i for i in range(episodes)
                ],
            }
        bar.close()
    finally:
        env.close()
    rates = [t["success_rate"] for t in per_task.values()]
    return report | {
        "tasks": per_task,
        "success_rate": sum(rates) / len(rates),
        "episodes": episodes * len(chosen),
        "time_s": time.time() - start,
    }


def _tasks(env: EmbodiedEnv, names: list[str] | None) -> list[str]:
    """``names`` checked against the env's tasks (None: every task)."""
    if not names:
        return list(env.tasks)
    unknown = [n for n in names if n not in env.tasks]
    if unknown:
        raise ValueError(f"tasks {unknown} are not tasks of this env; allowed: {list(env.tasks)}")
    return list(names)


def _rate(results: list[tuple[bool, int]]) -> float:
    return sum(ok for ok, _ in results) / len(results)


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
