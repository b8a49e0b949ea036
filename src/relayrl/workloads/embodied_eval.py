"""The embodied workload's evaluation: the ``evaluator`` role and the in-run evaluation it plays.

Every in-run evaluation (before RL, every ``log.eval_every`` steps, at the end) takes the trainer's
current weights (what ``save_pretrained`` writes) by reference and deals the run's protocol
(``relayrl.executors.evaluator.EvalProtocol``) over the evaluators, which play whole episodes
and return what each did: no observation passes through the driver. ``relayrl eval RUN`` plays
the same protocol with the same ``Evaluator`` on the saved checkpoint, so it reproduces the
final evaluation task by task.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

from relayrl.executors.evaluator import (
    EvalProtocol,
    Evaluator,
    eval_env,
    protocol_name,
)
from relayrl.executors.worker_side import policy_weights
from relayrl.recovery import DEATHS, ExecutorFailed, alive, first_line
from relayrl.roles import Role, ray_resources

EVAL_SEED = 10**6  # evaluator i builds its env with seed run.seed + this + 1000 + i


def evaluator_role(w: Any) -> Role:
    """The ``evaluator`` row of the embodied workload ``w``'s role table: ``env.eval_workers``
    evaluators, placed as rollout workers are, each with its env and a copy of the policy."""
    cfg = w.cfg

    def make(i: int, incarnation: int) -> tuple[tuple, dict[str, Any]]:
        seed = cfg.run.seed + EVAL_SEED + 1000 + i + incarnation * cfg.env.eval_workers
        if w.env_given:  # the run's env replaced (a test's, a library user's)
            env = functools.partial(w.make_env, seed)
        else:
            env = eval_env(cfg, protocol_name(cfg), seed)
        return (env, w.vla), {"threads": cfg.ray.threads_per_executor}

    return Role(
        "evaluator",
        Evaluator,
        cfg.env.eval_workers,
        make,
        **ray_resources(cfg.rollout.resources),
        replaced=True,
        keeps="nothing: an evaluation plays its episodes from their seeds",
    )


async def evaluate(w: Any) -> dict:
    """Play the run's evaluation protocol with the trainer's current policy on ``w``'s
    evaluators; a dead evaluator is replaced and the evaluation played again in full."""
    start = time.time()
    protocol = EvalProtocol.of(w.cfg, w.tasks)
    while True:
        # Every rank takes part (a sharded group gathers the weights); rank 0's are whole.
        weights = [rank.__ray_call__.remote(policy_weights) for rank in w.trainer]
        shares = protocol.deal(len(w.evaluators))
        plays = [
            evaluator.play.remote(share, protocol.greedy, weights[0])
            for evaluator, share in zip(w.evaluators, shares, strict=True)
        ]
        try:
            played = await asyncio.gather(*plays)
            await asyncio.gather(*weights[1:])
            break
        except DEATHS as err:
            await _replace_dead(w, err)
    version = (await w.trainer[0].stats.remote()).version
    outcomes = [o for share in played for o in share]
    report = protocol.report(outcomes)
    n = len(outcomes)
    rate = sum(o.success for o in outcomes) / max(n, 1)
    return {
        "accuracy": rate,  # the name the report and learning curve read
        "success_rate": rate,
        "n": n,
        "episode_len": sum(o.steps for o in outcomes) / max(n, 1),
        "env_errors": report["env_errors"],
        "version": version,
        "time_s": time.time() - start,
        "per_task": report["tasks"],
    }


async def _replace_dead(w: Any, err: BaseException) -> None:
    """After an evaluation met a death: fail the run naming a dead trainer rank, else replace
    the dead evaluators (their episodes are in no books); re-raise when none died."""
    for name, rank in w.trainer.named().items():
        if not await alive(rank):
            raise ExecutorFailed(name, first_line(err)) from err
    if w.recovery is None:
        raise err
    dead = [i for i, e in enumerate(w.evaluators) if not await alive(e)]
    if not dead:
        raise err
    for i in dead:
        await w.recovery.replace(w.evaluators, i, err)
