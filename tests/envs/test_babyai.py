"""BabyAI adapter: observations, minigrid's success, the distractor rule and its effect on a blind
policy."""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import pytest

pytest.importorskip("minigrid", reason='BabyAI needs minigrid: pip install "relayrl[babyai]"')

from relayrl.envs.babyai import BabyAIEnv  # noqa: E402

LEVEL = "BabyAI-GoToLocalS7N4-v0"
DIRS = ((1, 0), (0, 1), (-1, 0), (0, -1))  # minigrid's agent_dir 0..3: east, south, west, north
OBJECTS = ("ball", "box", "key")


def plan_to_face(env: BabyAIEnv, goal: tuple[int, int]) -> list[int] | None:
    """Breadth-first actions that end facing ``goal`` without facing any other object on the way."""
    grid = env._envs[env._task].unwrapped

    def front(pos: tuple[int, int], d: int) -> tuple[int, int]:
        return pos[0] + DIRS[d][0], pos[1] + DIRS[d][1]

    def faces_object(pos: tuple[int, int], d: int) -> bool:
        cell = grid.grid.get(*front(pos, d))
        return cell is not None and cell.type in OBJECTS

    start = (tuple(int(v) for v in grid.agent_pos), int(grid.agent_dir))
    queue, seen = deque([(start, [])]), {start}
    while queue:
        (pos, d), actions = queue.popleft()
        if front(pos, d) == goal:
            return actions
        if actions and faces_object(pos, d):
            continue
        ahead = front(pos, d)
        moves = [(0, (pos, (d - 1) % 4)), (1, (pos, (d + 1) % 4))]
        if grid.grid.get(*ahead) is None:
            moves.append((2, (ahead, d)))
        for action, state in moves:
            if state not in seen:
                seen.add(state)
                queue.append((state, [*actions, action]))
    return None


def episode_towards(rule: bool, want_target: bool) -> tuple[BabyAIEnv, list, int]:
    """An env reset on the first seed where a clean path to a target (or a distractor) exists, the
    step results of following it, and the level's step limit."""
    for seed in range(50):
        env = BabyAIEnv(LEVEL, distractor_fails=rule, seed=seed)
        env.reset()
        base = env._envs[LEVEL].unwrapped
        targets = {tuple(int(v) for v in p) for p in base.instrs.desc.obj_poss}
        objects = [
            (i, j)
            for i in range(base.grid.width)
            for j in range(base.grid.height)
            if (c := base.grid.get(i, j)) is not None and c.type in OBJECTS
        ]
        goals = [o for o in objects if (o in targets) == want_target]
        for goal in goals:
            plan = plan_to_face(env, goal)
            if plan:
                return env, [env.step(a) for a in plan], base.max_steps
    raise AssertionError("no seed gave a clean path")


def test_observation_shape_instruction_and_tasks():
    env = BabyAIEnv(LEVEL, image_size=56)
    obs = env.reset()
    assert env.tasks == (LEVEL,)
    assert env.action_space.kind == "discrete" and env.action_space.n == 3
    assert obs.image.shape == (1, 56, 56, 3) and obs.image.dtype == np.uint8
    assert obs.instruction.startswith("go to the ")
    assert obs.task == LEVEL and obs.step == 0
    result = env.step(2)
    assert result.obs.step == 1 and result.obs.instruction == obs.instruction
    assert BabyAIEnv(LEVEL, image_size=21).reset().image.shape == (1, 21, 21, 3)


def test_same_seed_gives_same_episode():
    first = BabyAIEnv(LEVEL, seed=3).reset()
    again = BabyAIEnv(LEVEL, seed=3).reset()
    assert first.instruction == again.instruction
    assert np.array_equal(first.image, again.image)


def test_reaching_the_target_succeeds_with_minigrid_reward():
    env, results, max_steps = episode_towards(rule=True, want_target=True)
    assert not any(r.terminated for r in results[:-1])
    last = results[-1]
    assert last.terminated and last.success and not last.truncated
    assert last.info["distractor"] is False
    # minigrid's success reward: 1 - 0.9 * steps / max_steps
    assert last.reward == pytest.approx(1 - 0.9 * len(results) / max_steps)


def test_facing_a_distractor_fails_the_episode():
    env, results, _ = episode_towards(rule=True, want_target=False)
    assert not any(r.terminated for r in results[:-1])
    last = results[-1]
    assert last.terminated and not last.success and not last.truncated
    assert last.reward == 0.0 and last.info["distractor"] is True


def test_without_the_rule_a_distractor_does_not_end_the_episode():
    env, results, _ = episode_towards(rule=False, want_target=False)
    last = results[-1]
    assert not last.terminated and not last.success and last.info["distractor"] is False


def test_truncation_at_max_steps():
    env = BabyAIEnv(LEVEL, distractor_fails=False, max_steps=3)
    env.reset()
    results = [env.step(0) for _ in range(3)]  # turning in place never reaches anything
    assert [r.truncated for r in results] == [False, False, True]
    assert not results[-1].terminated and not results[-1].success


def random_success_rate(rule: bool, episodes: int) -> float:
    """Success rate of uniformly random left/right/forward actions (fixed seeds)."""
    env, rng, wins = BabyAIEnv(LEVEL, distractor_fails=rule, seed=0), np.random.default_rng(0), 0
    for _ in range(episodes):
        env.reset()
        while not ((r := env.step(int(rng.integers(3)))).terminated or r.truncated):
            pass
        wins += r.success
    return wins / episodes


def test_rule_cuts_a_random_policys_success():
    start = time.perf_counter()
    with_rule, without = random_success_rate(True, 50), random_success_rate(False, 50)
    print(f"random 3-action success: {with_rule:.2f} with the rule, {without:.2f} without")
    print(f"({time.perf_counter() - start:.1f} s for 100 episodes)")
    assert with_rule < without - 0.1  # measured 0.26 and 0.48


def test_sampling_rejected_lines_are_silenced(capsys):
    env = BabyAIEnv(LEVEL)
    for seed in range(30):
        env.reset(seed=seed)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"image_size": 50}, "image_size must be a positive multiple of the 7-cell view"),
        ({"level": "BabyAI-NoSuchLevel-v0"}, "'BabyAI-NoSuchLevel-v0' is not a registered"),
        ({"level": []}, "at least one"),
        ({"max_steps": 0}, "max_steps must be a positive int"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BabyAIEnv(**kwargs)


def test_several_levels_and_bad_action_or_task():
    levels = [LEVEL, "BabyAI-GoToLocalS5N2-v0"]
    env = BabyAIEnv(levels)
    assert env.tasks == tuple(levels)
    assert env.reset(task=levels[1]).task == levels[1]
    with pytest.raises(ValueError, match="is not one of this env's tasks"):
        env.reset(task="BabyAI-GoToObj-v0")
    with pytest.raises(ValueError, match="action must be 0"):
        env.step(3)


def test_rule_needs_a_single_object_mission():
    env = BabyAIEnv("BabyAI-GoToSeqS5R2-v0")
    with pytest.raises(ValueError, match="distractor_fails=False"):
        env.reset(seed=1)  # this seed's mission is a sequence of four 'go to's


@pytest.mark.parametrize(
    "level", ["BabyAI-GoToLocalS5N2-v0", "BabyAI-GoToLocalS6N3-v0", "BabyAI-GoToLocalS7N4-v0"]
)
def test_the_rule_leaves_the_levels_solvable(level: str) -> None:
    # A planner that sees the whole room and steers round the distractors succeeds in nearly every
    # episode: the rule makes the instruction matter without making episodes unwinnable.
    env, wins, n = BabyAIEnv(level, seed=3), 0, 100
    for _ in range(n):
        env.reset()
        base = env._envs[level].unwrapped
        plans = [plan_to_face(env, tuple(int(v) for v in p)) for p in base.instrs.desc.obj_poss]
        plan = min((p for p in plans if p is not None), key=len, default=None)
        if plan:
            wins += [env.step(a) for a in plan][-1].success
    assert wins >= 0.95 * n


def test_full_view_keeps_the_grid_in_frame_and_a_turn_changes_only_the_agents_cell():
    env = BabyAIEnv(LEVEL, image_size=28, view="full")
    first = env.reset(seed=3).image
    assert first.shape == (1, 28, 28, 3)
    x, y = env._envs[LEVEL].unwrapped.agent_pos
    turned = env.step(0).obs.image  # turn left: the agent stays in its cell
    changed = np.argwhere((turned != first).any(axis=-1)[0])
    assert len(changed) > 0
    # S7N4's grid is 7 cells: 4-pixel tiles; every changed pixel lies in the agent's tile.
    assert set(map(tuple, changed // 4)) == {(y, x)}
    ego = BabyAIEnv(LEVEL, image_size=28)
    before = ego.reset(seed=3).image
    after = ego.step(0).obs.image
    assert len(np.argwhere((after != before).any(axis=-1)[0])) > 2 * len(changed)


def test_full_view_pads_a_smaller_grid_to_the_largest_levels_scale():
    env = BabyAIEnv([LEVEL, "BabyAI-GoToLocalS5N2-v0"], image_size=28, view="full")
    small = env.reset(task="BabyAI-GoToLocalS5N2-v0").image[0]
    assert small.shape == (28, 28, 3)
    assert small[20:].max() == 0 and small[:, 20:].max() == 0  # 5 cells of 4 pixels, then black
    assert small[:4, :4].max() > 0  # the corner wall is drawn
    alone = BabyAIEnv("BabyAI-GoToLocalS5N2-v0", image_size=28, view="full").reset().image[0]
    assert alone[20:].max() == 0 and alone[:20, :20].max() > 0  # the same scale on its own
    with pytest.raises(ValueError, match="BabyAI-GoToLocal-v0 has a 8-cell grid"):
        BabyAIEnv("BabyAI-GoToLocal-v0", image_size=28, view="full")
    with pytest.raises(ValueError, match="view must be one of egocentric, full, both"):
        BabyAIEnv(LEVEL, view="top")


def test_both_views_are_the_egocentric_then_the_full_view_of_the_same_step():
    both, ego, full = (
        BabyAIEnv(LEVEL, image_size=28, view=v) for v in ("both", "egocentric", "full")
    )
    frames = [env.reset(seed=5).image for env in (both, ego, full)]
    for action in (2, 0, 2, 1):
        frames += [env.step(action).obs.image for env in (both, ego, full)]
    for at in range(0, len(frames), 3):
        pair, alone_ego, alone_full = frames[at : at + 3]
        assert pair.shape == (2, 28, 28, 3)
        assert np.array_equal(pair[0], alone_ego[0]) and np.array_equal(pair[1], alone_full[0])
    with pytest.raises(ValueError, match="view=both draws the grid at the 7-cell view's scale"):
        BabyAIEnv("BabyAI-GoToLocal-v0", image_size=28, view="both")
