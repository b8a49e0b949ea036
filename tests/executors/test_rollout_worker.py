"""Rollout worker: segmentation of episodes, crash containment with step accounting (through
``collect``, the lockstep call), the async run loop, and a run end to end through the inference
service into the replay buffer."""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading

import numpy as np
import pytest
import torch

from relayrl.envs.embodied import ActionSpace, Observation, StepResult
from relayrl.executors.inference_service import ActReply, InferenceService
from relayrl.executors.replay_buffer import ReplayBuffer
from relayrl.executors.rollout_worker import Collected, EpisodeResult, RolloutWorker
from relayrl.types import TaskCounts


class ScriptedEnv:
    """Episodes of ``length`` steps; the image at step t is filled with 10 * t + ``offset``; the
    reward is the
    action; task "a" succeeds, any other fails. ``fail_step`` / ``fail_reset`` list the calls
    (1-based, counted per env) that raise."""

    action_space = ActionSpace("discrete", 4)
    tasks = ("a", "b")

    def __init__(self, length=7, truncate=False, fail_step=(), fail_reset=(), offset=0):
        self.length, self.truncate, self.offset = length, truncate, offset
        self.fail_step, self.fail_reset = set(fail_step), set(fail_reset)
        self.step_calls = self.reset_calls = 0
        self.closed = False
        self.seeds: list[int] = []

    def reset(self, *, task=None, seed=None):
        self.reset_calls += 1
        if self.reset_calls in self.fail_reset:
            raise RuntimeError("reset crashed")
        self.task, self.t = task or self.tasks[0], 0
        self.seeds.append(seed)
        return self._obs()

    def step(self, action):
        self.step_calls += 1
        if self.step_calls in self.fail_step:
            raise RuntimeError(f"sim crashed at call {self.step_calls}")
        self.t += 1
        done = self.t == self.length
        return StepResult(
            self._obs(),
            reward=float(action),
            terminated=done and not self.truncate,
            truncated=done and self.truncate,
            success=done and self.task == "a",
        )

    def close(self):
        self.closed = True

    def _obs(self):
        image = np.full((1, 2, 2, 3), 10 * self.t + self.offset, np.uint8)
        return Observation(image, f"do {self.task}", self.task, self.t)


class Factory:
    """Builds envs from a list of keyword sets (the last one repeats) and keeps them."""

    def __init__(self, *kwargs):
        self.kwargs, self.built = list(kwargs) or [{}], []

    def __call__(self):
        self.built.append(ScriptedEnv(**self.kwargs[min(len(self.built), len(self.kwargs) - 1)]))
        return self.built[-1]


class StepPolicy:
    """A service that answers action = the episode step mod 4, mu = -step / 100, value = step."""

    def __init__(self, version: int = 0):
        self.version = version

    def __call__(self, obs: Observation, *asked: int) -> ActReply:
        logprobs = np.array([-obs.step / 100], np.float32)
        return ActReply(np.array([obs.step % 4]), logprobs, float(obs.step), self.version)


def drive(worker: RolloutWorker, segments: int, version: int = 0) -> list:
    """Lockstep: ``collect`` ``segments`` segments, answered by ``StepPolicy``."""
    _, closed = worker.collect(StepPolicy(version), segments)
    return closed


def pixels(seg) -> list[int]:
    return seg.images[:, 0, 0, 0, 0].tolist()


def test_an_episode_of_7_steps_with_l_3_is_cut_into_3_3_1():
    worker = RolloutWorker(2, Factory(), segment_len=3, seed=0)
    segs = drive(worker, 3, version=5)
    assert [len(s) for s in segs] == [3, 3, 1]
    assert [(s.terminated, s.episode_done, s.success) for s in segs] == [
        (False, False, False),
        (False, False, False),
        (True, True, True),
    ]
    assert [pixels(s) for s in segs] == [[0, 10, 20, 30], [30, 40, 50, 60], [60, 70]]
    assert [s.steps.tolist() for s in segs] == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7]]
    assert [s.actions[:, 0].tolist() for s in segs] == [[0, 1, 2], [3, 0, 1], [2]]
    assert segs[1].rewards.tolist() == [3.0, 0.0, 1.0]
    np.testing.assert_allclose(segs[1].logprobs[:, 0], [-0.03, -0.04, -0.05])
    assert segs[1].values.tolist() == [3.0, 4.0, 5.0]
    assert all(s.versions.tolist() == [5] * len(s) for s in segs)
    assert {(s.worker, s.episode, s.task, s.instruction) for s in segs} == {(2, 0, "a", "do a")}
    assert worker.episode_results() == [EpisodeResult(2, 0, "a", True, 9.0, 7)]
    assert worker.episode_results() == []  # drained
    stats = worker.stats()
    assert (stats.env_steps, stats.segments, stats.segment_steps) == (7, 3, 7)
    assert stats.tasks == {"a": TaskCounts(episodes=1, successes=1)}
    (after,) = drive(worker, 1)  # the next call starts episode 1
    assert (after.episode, after.steps[0]) == (1, 0)


def test_a_truncated_episode_ends_its_last_segment_without_terminated():
    worker = RolloutWorker(0, Factory({"length": 3, "truncate": True}), segment_len=3, seed=0)
    (seg,) = drive(worker, 1)
    assert (seg.terminated, seg.episode_done, seg.success) == (False, True, True)


def test_env_crashes_are_contained_counted_and_the_env_rebuilt():
    # The first env raises at its 5th step; its replacement fails its first reset.
    factory = Factory({"fail_step": [5]}, {"fail_reset": [1]}, {})
    worker = RolloutWorker(0, factory, segment_len=3, seed=0)
    assert [len(s) for s in drive(worker, 1)] == [3]  # steps 1-3
    # Step 4 opens a segment and step 5 crashes: its step is dropped and the env rebuilt; the
    # rebuilt env's reset crashes, so a third env plays a whole episode.
    collected, segs = worker.collect(StepPolicy(), segments=3)
    assert [len(s) for s in segs] == [3, 3, 1] and segs[0].steps[0] == 0
    assert collected == Collected(0, steps=7, worker_env_steps=11, worker_dropped_error=1)
    stats = worker.stats()
    assert (stats.env_steps, stats.env_errors, stats.dropped_error_steps) == (11, 2, 1)
    assert stats.last_errors == [
        "step: RuntimeError: sim crashed at call 5",
        "reset: RuntimeError: reset crashed",
    ]
    assert len(factory.built) == 3 and factory.built[0].closed
    assert stats.env_steps == stats.segment_steps + stats.dropped_error_steps
    assert stats.episodes == 1  # a crashed episode has no result


def test_step_accounting_holds_with_crashes_at_random_steps():
    rng = np.random.default_rng(0)
    fails = [{"fail_step": [int(rng.integers(1, 15))]} for _ in range(20)]
    worker = RolloutWorker(0, Factory(*fails), segment_len=4, seed=0)
    drive(worker, 30)
    stats = worker.stats()
    assert stats.env_errors > 0 and stats.dropped_error_steps > 0
    emitted = stats.segment_steps + stats.dropped_error_steps + stats.open_steps
    assert stats.env_steps == emitted


def test_a_broken_env_makes_the_worker_give_up():
    worker = RolloutWorker(
        0, Factory({"fail_reset": [1]}), segment_len=3, seed=0, max_consecutive_errors=3
    )
    with pytest.raises(RuntimeError, match="3 env errors in a row"):
        drive(worker, 1)


def test_the_task_sampler_picks_the_task_at_each_reset():
    tasks = itertools.cycle(["a", "b"])
    worker = RolloutWorker(
        0, Factory({"length": 2}), segment_len=5, seed=0, task_sampler=lambda: next(tasks)
    )
    segs = drive(worker, 4)
    assert [s.task for s in segs] == ["a", "b", "a", "b"]
    assert worker.stats().tasks == {
        "a": TaskCounts(episodes=2, successes=2),
        "b": TaskCounts(episodes=2, successes=0),
    }


def test_run_loops_until_max_segments_or_stop():
    asked = []

    def service(obs: Observation, worker: int, env_steps: int) -> ActReply:
        asked.append((worker, env_steps))
        return ActReply(np.array([1]), np.array([-0.5], np.float32), 0.25, version=3)

    worker = RolloutWorker(4, Factory(), segment_len=3, seed=0)
    segments: list = []
    assert worker.run(service, segments.append, max_segments=5) == 5
    assert [len(s) for s in segments] == [3, 3, 1, 3, 3]
    # Each request carries the worker's id and the env steps it took before it (a reset is none).
    assert asked == [(4, n) for n in range(13)]
    assert all(s.versions.tolist() == [3] * len(s) for s in segments)
    assert worker.stats().open_steps == 0

    def sink(segment) -> None:
        segments.append(segment)
        if len(segments) == 7:
            worker.stop()

    assert worker.run(service, sink) == 2


class BatchedService:
    """A service with ``act_many``: action = the episode step mod 4, value = the mean pixel."""

    def __init__(self):
        self.batches: list[int] = []

    def act_many(self, observations, worker, env_steps):
        self.batches.append(len(observations))
        return [
            ActReply(np.array([o.step % 4]), np.array([-0.5], np.float32), o.image.mean(), 1)
            for o in observations
        ]


class RoundSink:
    """A sink with ``put_many``: records the segments of each call."""

    def __init__(self):
        self.calls: list[list] = []

    def put_many(self, segments) -> None:
        self.calls.append(list(segments))


@pytest.mark.parametrize("env_threads", [True, False])
def test_a_worker_steps_several_envs_with_one_request_and_keeps_one_set_of_books(env_threads):
    # Env 0 crashes at its 5th step, env 2 at its 9th; episodes are 7 steps (L = 3).
    factory = Factory({"fail_step": [5]}, {"offset": 1}, {"fail_step": [9], "offset": 2}, {})
    worker = RolloutWorker(0, factory, segment_len=3, seed=0, envs=3, env_threads=env_threads)
    service = BatchedService()
    sink = RoundSink()
    worker.run(service, sink, max_segments=20)
    # One call per round that closed segments: a round closes one per env at most.
    assert sink.calls and all(1 <= len(call) <= 3 for call in sink.calls)
    assert max(len(call) for call in sink.calls) > 1
    segments = [seg for call in sink.calls for seg in call]
    assert set(service.batches) == {3}  # every request asked for all three envs
    stats = worker.stats()
    assert stats.env_errors == 2 and stats.dropped_error_steps > 0
    emitted = stats.segment_steps + stats.dropped_error_steps + stats.open_steps
    assert stats.env_steps == emitted
    assert stats.segment_steps == sum(len(s) for s in segments)
    by_episode: dict[int, list] = {}
    for seg in segments:
        by_episode.setdefault(seg.episode, []).append(seg)
    for episode in by_episode.values():  # one env's episode: its steps follow on, one env's pixels
        steps = [int(x) for seg in episode for x in seg.steps[:-1]]
        assert steps == list(range(steps[0], steps[0] + len(steps)))
        assert len({p % 10 for seg in episode for p in pixels(seg)}) == 1
        for seg in episode:
            assert seg.actions[:, 0].tolist() == [t % 4 for t in seg.steps[:-1].tolist()]
            assert seg.values.tolist() == pixels(seg)[:-1]
    done = [e for e in by_episode.values() if e[-1].episode_done]
    assert done and all(sum(len(seg) for seg in e) == 7 for e in done)
    assert stats.episodes == len(done)


def test_state_dict_keeps_the_books_of_emitted_steps():
    # Env 1's episodes are 2 steps: the second round closes its segment, and env 0 holds 2 open.
    worker = RolloutWorker(0, Factory({}, {"length": 2}), segment_len=3, seed=0, envs=2)
    assert worker.run(StepPolicy(), [].append, max_segments=1) == 1
    assert (worker.stats().env_steps, worker.stats().open_steps) == (4, 2)
    restored = RolloutWorker(0, Factory(), segment_len=3, seed=1)
    restored.load_state_dict(worker.state_dict())
    stats = restored.stats()
    assert (stats.env_steps, stats.segment_steps, stats.open_steps) == (2, 2, 0)
    (seg,) = drive(restored, 1)  # a fresh episode, numbered after the two begun before
    assert (seg.episode, seg.steps[0]) == (2, 0)


class PixelPolicy(torch.nn.Module):
    """action = mean pixel // 10 mod 4, mu = -1, value = mean pixel: every answer can be checked."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(1))

    def act(self, images, instructions, steps, *, greedy=False, generator=None):
        actions = (images.float().mean(dim=(1, 2, 3, 4)) / 10).long().remainder(4)[:, None]
        return actions, torch.full(actions.shape, -1.0), images.float().mean(dim=(1, 2, 3, 4))


def test_workers_run_through_the_inference_service_into_the_replay_buffer():
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()
    service = InferenceService(PixelPolicy(), max_batch=3, max_wait_ms=5)

    def act(obs: Observation, worker: int, env_steps: int) -> ActReply:
        call = service.act(obs, worker, env_steps)
        return asyncio.run_coroutine_threadsafe(call, loop).result(timeout=30)

    buffer = ReplayBuffer(1000, max_staleness=None)
    workers = [RolloutWorker(i, Factory(), segment_len=3, seed=i) for i in range(3)]
    threads = [
        threading.Thread(target=w.run, args=(act, buffer.put), kwargs={"max_segments": 6})
        for w in workers
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    stats = asyncio.run_coroutine_threadsafe(service.stats(), loop).result(timeout=30)
    reported = [
        asyncio.run_coroutine_threadsafe(service.reported(i), loop).result(timeout=30)
        for i in range(3)
    ]
    asyncio.run_coroutine_threadsafe(service.close(), loop).result(timeout=30)
    loop.call_soon_threadsafe(loop.stop)
    loop_thread.join(10)
    segments = buffer.get(min_steps=buffer.stats().resident_steps, trainer_version=0)
    assert len(segments) == 18 and {s.worker for s in segments} == {0, 1, 2}
    for seg in segments:
        assert seg.actions[:, 0].tolist() == [p // 10 % 4 for p in pixels(seg)[:-1]]
        assert seg.values.tolist() == pixels(seg)[:-1]
    assert stats.requests == sum(w.stats().env_steps for w in workers)
    # A worker's last request came before its last step, which closed its sixth segment.
    assert reported == [w.stats().env_steps - 1 for w in workers]
    assert sum(w.stats().wait_s for w in workers) > 0


class RemoteService:
    """What the controller hands a worker actor: the service actor behind a plain callable."""

    def __init__(self, handle):
        self.handle = handle

    def __call__(self, obs: Observation, worker: int, env_steps: int) -> ActReply:
        import ray

        return ray.get(self.handle.act.remote(obs, worker, env_steps))


class RemoteSink:
    def __init__(self, handle):
        self.handle = handle

    def __call__(self, segment) -> None:
        import ray

        ray.get(self.handle.put.remote(segment))


def test_as_ray_actors_workers_stream_through_the_service_into_the_buffer(ray_session):
    ray = ray_session
    # The policy, env and wrappers live in this test module, which Ray's workers cannot import.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actor = ray.remote(num_cpus=0)
    service = actor(InferenceService).remote(PixelPolicy(), max_batch=2, max_wait_ms=20)
    # Threaded: the trainer's blocking get must not block the workers' puts.
    buffer = actor(ReplayBuffer).options(max_concurrency=4).remote(10_000, max_staleness=None)
    workers = [
        actor(RolloutWorker)
        .options(max_concurrency=2)  # stop() and stats() are served while run() loops
        .remote(i, Factory({"offset": 5 * i}), segment_len=3, seed=i)
        for i in range(2)
    ]
    runs = [w.run.remote(RemoteService(service), RemoteSink(buffer)) for w in workers]
    segments = ray.get(buffer.get.remote(40, trainer_version=0, timeout_s=60), timeout=90)
    ray.get([w.stop.remote() for w in workers], timeout=30)
    emitted = ray.get(runs, timeout=30)
    for seg in segments:  # a reply sent to the wrong worker would break these
        assert seg.values.tolist() == pixels(seg)[:-1]
        assert all(p % 10 == 5 * seg.worker for p in pixels(seg))
    assert sum(len(s) for s in segments) >= 40
    assert ray.get(buffer.stats.remote()).put_segments == sum(emitted)
    batch_sizes = ray.get(service.stats.remote()).batch_sizes
    assert max(batch_sizes) == 2  # the two workers' requests shared forward passes
    for handle in (service, buffer, *workers):
        ray.kill(handle)


class ThreadRecordingEnv(ScriptedEnv):
    """Records the thread of every call: GL-rendering envs must stay on one thread."""

    def __init__(self):
        super().__init__()
        self.threads = {threading.get_ident()}

    def reset(self, **kwargs):
        self.threads.add(threading.get_ident())
        return super().reset(**kwargs)

    def step(self, action):
        self.threads.add(threading.get_ident())
        return super().step(action)


def test_every_env_call_runs_on_one_thread_whoever_calls_the_worker():
    """A threaded Ray actor serves calls from several threads; the env must not notice."""
    envs = []
    worker = RolloutWorker(
        0, lambda: envs.append(ThreadRecordingEnv()) or envs[-1], segment_len=3, seed=0
    )
    for _ in range(3):
        thread = threading.Thread(target=drive, args=(worker, 1))
        thread.start()
        thread.join()
    drive(worker, 1)
    assert len(envs) == 1 and len(envs[0].threads) == 1
    assert threading.get_ident() not in envs[0].threads


def test_without_env_threads_the_envs_run_on_the_callers_thread():
    envs = []
    worker = RolloutWorker(
        0,
        lambda: envs.append(ThreadRecordingEnv()) or envs[-1],
        segment_len=3,
        seed=0,
        env_threads=False,
    )
    drive(worker, 1)
    assert len(envs) == 1 and envs[0].threads == {threading.get_ident()}
