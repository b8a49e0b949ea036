"""The evaluation protocol: which episodes it plays (hand-counted), that an episode's outcome
depends on the weights, the task and its index only, and how a report adds up."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from relayrl.executors.evaluator import (
    SEED_STRIDE,
    EvalProtocol,
    Evaluator,
    Outcome,
    eval_env,
)
from relayrl.models.vla import VLAPolicy, vla_config
from relayrl.types import EvaluatorStats

TASKS = ("BabyAI-GoToLocalS5N2-v0", "BabyAI-GoToLocalS6N3-v0")
ENV = [
    f"env.tasks=[{','.join(TASKS)}]",
    "env.image_size=28",
    "vla.patch_size=4",
    "env.max_steps=12",
]


def test_the_episodes_are_split_over_the_tasks_in_turn_and_seeded_by_index():
    cfg = tiny_config("workload=embodied", *ENV, "env.eval_episodes=5", "run.seed=3")
    protocol = EvalProtocol.of(cfg, TASKS)
    assert protocol.episodes == (3, 2) and protocol.seed == 3 and protocol.greedy is False
    plan = protocol.plan()
    assert [(e.task, e.i, e.seed) for e in plan] == [
        (TASKS[0], 0, 3 * SEED_STRIDE),
        (TASKS[0], 1, 3 * SEED_STRIDE + 1),
        (TASKS[0], 2, 3 * SEED_STRIDE + 2),
        (TASKS[1], 0, 3 * SEED_STRIDE),
        (TASKS[1], 1, 3 * SEED_STRIDE + 1),
    ]
    assert [len(share) for share in protocol.deal(2)] == [3, 2]
    assert protocol.deal(2)[1] == [plan[1], plan[3]]
    # Per task on request, one task, another seed, greedy.
    chosen = EvalProtocol.of(cfg, TASKS, tasks=[TASKS[1]], episodes=4, seed=0, greedy=True)
    assert chosen.tasks == (TASKS[1],) and chosen.episodes == (4,) and chosen.greedy
    assert [e.seed for e in chosen.plan()] == [0, 1, 2, 3]


def test_bad_protocol_choices_are_refused_naming_them():
    cfg = tiny_config("workload=embodied", *ENV)
    with pytest.raises(ValueError, match="not tasks of this env"):
        EvalProtocol.of(cfg, TASKS, tasks=["BabyAI-Nope-v0"])
    with pytest.raises(ValueError, match="episodes must be >= 1, got 0"):
        EvalProtocol.of(cfg, TASKS, episodes=0)
    with pytest.raises(ValueError, match="protocol 'libero' needs env.name=libero"):
        EvalProtocol.of(cfg, TASKS, name="libero")


def test_a_report_adds_up_per_task_and_over_tasks():
    cfg = tiny_config("workload=embodied", *ENV, "env.eval_episodes=5")
    protocol = EvalProtocol.of(cfg, TASKS)
    outcomes = [
        Outcome(TASKS[0], 0, True, 4),
        Outcome(TASKS[0], 1, False, 12),
        Outcome(TASKS[0], 2, True, 2),
        Outcome(TASKS[1], 0, False, 7, "RuntimeError: crashed"),
        Outcome(TASKS[1], 1, True, 5),
    ]
    report = protocol.report(outcomes)
    assert report["tasks"][TASKS[0]] == {
        "episodes": 3,
        "successes": 2,
        "success_rate": 2 / 3,
        "mean_steps": 6.0,
    }
    assert report["tasks"][TASKS[1]]["success_rate"] == 0.5
    assert report["success_rate"] == pytest.approx((2 / 3 + 1 / 2) / 2)
    assert report["episodes"] == 5 and report["env_errors"] == 1


def test_an_episode_plays_alike_in_any_evaluator_and_order():
    cfg = tiny_config("workload=embodied", *ENV, "env.eval_episodes=6")
    protocol = EvalProtocol.of(cfg, TASKS)
    vla = vla_config(cfg.vla, image_size=28, views=1, dims=1, vocab=7)
    torch.manual_seed(0)
    policy = {"version": 0, "weights": VLAPolicy(vla).state_dict()}
    one = Evaluator(eval_env(cfg, "seeded", 0), vla)
    alone = one.play(protocol.plan(), False, policy)
    assert len(alone) == 6 and one.stats() == EvaluatorStats(episodes=6)
    # Two other evaluators (other env seeds), each playing its share backwards.
    shares = protocol.deal(2)
    pair = [Evaluator(eval_env(cfg, "seeded", 10 + k), vla) for k in range(2)]
    dealt = [
        o for e, share in zip(pair, shares, strict=True) for o in e.play(share[::-1], False, policy)
    ]
    key = {(o.task, o.i): o for o in dealt}
    assert [key[(o.task, o.i)] for o in alone] == alone
    assert len({o.steps for o in alone}) > 1  # sampled: the episodes differ from each other
    # The most likely actions of other weights play other episodes (sampled ones barely differ:
    # both untrained policies are near uniform, and draw from the same seeded stream).
    torch.manual_seed(1)
    other = {"version": 0, "weights": VLAPolicy(vla).state_dict()}
    greedy = one.play(protocol.plan(), True)
    assert one.play(protocol.plan(), True, other) != greedy
