"""WorldModelEnv against a stand-in world-model service: an episode starts from a real context
drawn uniformly over the cached real steps, and ends on the success threshold, the failure head or
the step cap with the potential-based rewards, derived here by hand."""

from __future__ import annotations

import random
from concurrent.futures import Future

import numpy as np
import pytest

from relayrl.data.trajectories import Episode
from relayrl.envs.embodied import ActionSpace
from relayrl.envs.world_model_env import RealStarts, WorldModelEnv
from relayrl.models.world_model.imagine import PAD_ACTION
from relayrl.models.world_model.serving import WMReply, WMRequest

WM_VERSION = 7


class BrightnessService:
    """A world model whose frames are one brightness: action token a brightens by 1 + a, the
    success probability is brightness / 10, and token 2 leads to a failure frame. Replies are
    held until ``release`` when ``held``, else answered at once."""

    def __init__(self, held: bool = False):
        self.held = held
        self.requests: list[WMRequest] = []
        self.pending: list[tuple[WMRequest, Future]] = []

    def submit(self, request: WMRequest) -> Future:
        self.requests.append(request)
        future: Future = Future()
        self.pending.append((request, future))
        if not self.held:
            self.release()
        return future

    def release(self) -> None:
        for request, future in self.pending:
            future.set_result(self.answer(request))
        self.pending = []

    @staticmethod
    def answer(r: WMRequest) -> WMReply:
        value = int(r.context[-1].flat[0])
        if r.actions is None:
            return WMReply(None, min(value / 10, 1.0), 0.0, WM_VERSION)
        token = int(r.actions[-1, 0])
        value += 1 + token
        frame = np.full_like(r.context[-1], value)
        return WMReply(frame, min(value / 10, 1.0), float(token == 2), WM_VERSION)


def episode(brightness: list[int], task: str = "toy", actions: list[int] | None = None) -> Episode:
    """A real episode whose frames have the given brightnesses (one more frame than actions)."""
    steps = len(brightness) - 1
    return Episode(
        frames=np.stack([np.full((1, 2, 2, 3), b, np.uint8) for b in brightness]),
        actions=np.asarray(actions or [1] * steps, np.int64).reshape(steps, 1),
        rewards=np.zeros(steps, np.float32),
        instruction=f"brighten the {task}",
        task=task,
        seed=0,
        success=False,
        terminated=False,
        truncated=True,
    )


def make_env(service, *episodes: Episode, space=None, k: int = 2, **changes) -> WorldModelEnv:
    starts = RealStarts(8)
    for e in episodes:
        starts.add(e)
    settings = dict(threshold=0.9, max_steps=20, terminal_reward=1.0, fail_threshold=0.5) | changes
    return WorldModelEnv(
        service, starts, space or ActionSpace("discrete", 3), context_frames=k, **settings
    )


def play(env: WorldModelEnv, token: int) -> list:
    """Step ``env`` with ``token`` until its episode ends; the step results."""
    results = []
    while not results or not (results[-1].terminated or results[-1].truncated):
        results.append(env.step(token))
    return results


def test_reset_starts_from_the_real_frames_and_actions_up_to_the_drawn_step():
    service = BrightnessService()
    real = episode([10, 11, 12, 13, 14], actions=[0, 1, 0, 1])
    env = make_env(service, real, k=3)
    for seed in range(20):
        obs = env.reset(seed=seed)
        t = obs.step  # the drawn step; the frame shown is the real o_t
        assert 0 <= t < 4 and int(obs.image.flat[0]) == 10 + t
        assert obs.instruction == "brighten the toy" and obs.task == "toy"
        assert service.requests[-1].actions is None  # the start frame is judged, not stepped
        env.step(2)
        request = service.requests[-1]
        # o_{t-2} .. o_t, padded before o_0 with o_0; a_{t-2}, a_{t-1} padded, then the action.
        frames = [10 + max(i, 0) for i in range(t - 2, t + 1)]
        acts = [real.actions[i, 0] if i >= 0 else PAD_ACTION for i in range(t - 2, t)] + [2]
        assert [int(f.flat[0]) for f in request.context] == frames
        assert request.actions[:, 0].tolist() == acts
    # The same seed draws the same start.
    assert env.reset(seed=3).step == env.reset(seed=3).step


def test_starts_are_drawn_uniformly_over_the_cached_real_steps_of_the_task_asked_for():
    one, three = episode([0, 1], task="a"), episode([5, 6, 7, 8], task="b")
    env = make_env(BrightnessService(), one, three)
    drawn = [env.reset(seed=s).task for s in range(4000)]
    assert drawn.count("a") / len(drawn) == pytest.approx(1 / 4, abs=0.03)  # 1 step of 4
    assert {env.reset(task="b", seed=s).step for s in range(50)} == {0, 1, 2}
    with pytest.raises(ValueError, match=r"task='c': no real episode to start from; held: \['a'"):
        env.reset(task="c", seed=0)
    starts = RealStarts(2)
    starts.add(episode([0]))  # no step to act on: never a start
    assert len(starts) == 0
    with pytest.raises(ValueError, match="no real episode to start from"):
        starts.draw(random.Random(0))


def test_an_episode_ends_in_success_at_the_threshold_with_the_change_of_potential_as_reward():
    env = make_env(BrightnessService(), episode([5, 5]))
    assert env.reset(seed=0).step == 0  # the one real step
    results = play(env, 0)
    # Brightness 5 -> 6 -> 7 -> 8 -> 9: p rises by 0.1 a step and reaches 0.9 at the fourth.
    assert [r.reward for r in results] == pytest.approx([0.1, 0.1, 0.1, 0.1 + 1.0])
    assert [int(r.obs.image.flat[0]) for r in results] == [6, 7, 8, 9]
    assert [r.obs.step for r in results] == [1, 2, 3, 4]
    last = results[-1]
    assert last.terminated and last.success and not last.truncated
    assert not any(r.terminated or r.truncated for r in results[:-1])
    assert all(r.info == {"wm_version": WM_VERSION} for r in results)
    with pytest.raises(RuntimeError, match="call reset"):
        env.step(0)


def test_an_episode_ends_in_failure_on_the_failure_head_unless_it_succeeds_at_once():
    env = make_env(BrightnessService(), episode([3, 3]), episode([7, 7]))
    for seed in range(10):
        start = int(env.reset(seed=seed).image.flat[0])
        (result,) = play(env, 2)  # token 2: brightness + 3, a failure frame
        if start == 3:  # 3 -> 6: failure, no terminal reward, nothing bootstrapped
            assert result.terminated and not result.success and not result.truncated
            assert result.reward == pytest.approx(0.3)
        else:  # 7 -> 10: success and failure at once, success wins
            assert result.terminated and result.success
            assert result.reward == pytest.approx(1.0 - 0.7 + 1.0)


def test_an_episode_is_cut_at_max_steps_without_a_terminal_reward():
    env = make_env(BrightnessService(), episode([0, 0]), max_steps=3)
    env.reset(seed=0)
    results = play(env, 0)
    assert [r.reward for r in results] == pytest.approx([0.1, 0.1, 0.1])
    assert results[-1].truncated and not results[-1].terminated and not results[-1].success


def test_a_step_is_sent_at_once_and_its_reply_read_later():
    service = BrightnessService(held=True)
    space = ActionSpace("continuous", 2, low=(-1.0, -1.0), high=(1.0, 1.0), bins=4)
    env = make_env(service, episode([4, 4]), space=space, k=1)
    env.reset(seed=0)
    pending = env.submit_step(space.to_env(np.array([1, 3])))
    assert len(service.requests) == 2  # the start's judgement and the step, both in flight
    assert service.requests[-1].actions.tolist() == [[1, 3]]  # bin centres back to tokens
    service.release()
    result = pending.result()
    # Token 1 of the first dimension brightens 4 -> 6.
    assert int(result.obs.image.flat[0]) == 6 and result.reward == pytest.approx(0.2)
