"""Meta-World adapter: image observations, instruction, truncation and a scripted success."""

from __future__ import annotations

import numpy as np
import pytest

from relayrl.envs.metaworld import MT10, MetaWorldEnv  # before metaworld: sets MUJOCO_GL

pytest.importorskip(
    "metaworld", reason='Meta-World is not installed: pip install "relayrl[metaworld]"'
)


@pytest.fixture(scope="module")
def reach():
    env = MetaWorldEnv("reach-v3", image_size=32, cameras=("corner", "topview"), seed=0)
    yield env
    env.close()


def test_observation_and_step_types(reach):
    obs = reach.reset()
    assert obs.image.shape == (2, 32, 32, 3) and obs.image.dtype == np.uint8
    assert obs.image.std() > 0  # a rendered scene, not a blank buffer
    assert obs.instruction == "reach the red goal position" and obs.task == "reach-v3"
    space = reach.action_space
    assert (space.kind, space.dims, space.vocab) == ("continuous", 4, 256)
    result = reach.step(space.to_env(np.array([200, 10, 128, 255])))
    assert result.obs.step == 1 and result.obs.image.shape == (2, 32, 32, 3)
    assert isinstance(result.reward, float) and isinstance(result.success, bool)
    assert not result.terminated and not result.truncated


def test_same_seed_same_goal_and_image(reach):
    first = reach.reset(seed=5).image
    goal = reach._sims["reach-v3"].env._target_pos.copy()
    assert np.array_equal(reach.reset(seed=5).image, first)
    assert np.array_equal(reach._sims["reach-v3"].env._target_pos, goal)


def test_scripted_reach_succeeds_and_terminates(reach):
    reach.reset(seed=1)
    sim = reach._sims["reach-v3"].env
    for _ in range(200):
        # move the gripper centre straight at the goal; a step moves at most 1 cm per axis
        result = reach.step(np.append(np.clip((sim._target_pos - sim.tcp_center) * 100, -1, 1), 0))
        if result.terminated or result.truncated:
            break
    assert result.terminated and result.success and not result.truncated
    assert result.obs.step < 200


def test_truncation_at_max_steps():
    env = MetaWorldEnv("reach-v3", image_size=16, max_steps=3)
    env.reset()
    results = [env.step(np.zeros(4)) for _ in range(3)]
    assert [r.truncated for r in results] == [False, False, True]
    assert not any(r.terminated for r in results)
    env.close()


def test_mt10_lists_the_ten_tasks_and_resets_into_one():
    env = MetaWorldEnv("MT10", image_size=16)
    assert env.tasks == MT10 and len(env.tasks) == 10
    obs = env.reset(task="drawer-close-v3")
    assert obs.task == "drawer-close-v3" and obs.instruction == "close the drawer"
    with pytest.raises(ValueError, match="is not one of this env's tasks"):
        env.reset(task="assembly-v3")
    env.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tasks": "reach-v2"}, "unknown: \\['reach-v2'\\]"),
        ({"image_size": 0}, "image_size must be in \\[1, 480\\]"),
        ({"cameras": ()}, "cameras must name at least one camera"),
        ({"max_steps": 0}, "max_steps must be a positive int"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MetaWorldEnv(**kwargs)


def test_unknown_camera_is_named():
    env = MetaWorldEnv("reach-v3", cameras=("front",))
    with pytest.raises(ValueError, match="cameras \\['front'\\] are not in reach-v3"):
        env.reset()
