"""Meta-World (v3 tasks, MuJoCo) behind ``EmbodiedEnv``: camera images, a task description, a
4-dim continuous action (end-effector xyz delta and gripper) and ``info["success"]``.

Rendering is headless and tuned for CPUs: MuJoCo's EGL backend (importing this module sets
``MUJOCO_GL=egl`` unless it is already set), shadows and reflections off and no multisampling
(``offsamples=0``). With Meta-World's default settings a 64x64 frame costs ~90 ms on a CPU; with
these ~7 ms. The corner cameras are mounted upside down in Meta-World's scene, so their images are
flipped vertically.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from relayrl.envs.embodied import ActionSpace, Observation, StepResult

# MuJoCo picks its GL backend once, when it is first imported; the default (GLFW) needs a display
# and aborts the process without one.
os.environ.setdefault("MUJOCO_GL", "egl")

MT10 = (
    "reach-v3",
    "push-v3",
    "pick-place-v3",
    "door-open-v3",
    "drawer-open-v3",
    "drawer-close-v3",
    "button-press-topdown-v3",
    "peg-insert-side-v3",
    "window-open-v3",
    "window-close-v3",
)

# Human descriptions of the MT10 tasks; other tasks get their name with dashes as spaces.
INSTRUCTIONS = {
    "reach-v3": "reach the red goal position",
    "push-v3": "push the puck to the goal",
    "pick-place-v3": "pick up the puck and place it at the goal",
    "door-open-v3": "open the door",
    "drawer-open-v3": "open the drawer",
    "drawer-close-v3": "close the drawer",
    "button-press-topdown-v3": "press the button from the top",
    "peg-insert-side-v3": "insert the peg into the hole from the side",
    "window-open-v3": "slide the window open",
    "window-close-v3": "slide the window closed",
}

_MISSING = 'Meta-World needs the metaworld package: pip install "relayrl[metaworld]"'


def ensure_headless_gl() -> None:
    """Raise a clear error if MuJoCo was imported with a backend that needs a display we lack."""
    mujoco_gl = getattr(sys.modules.get("mujoco.gl_context"), "_MUJOCO_GL", None)
    if mujoco_gl in ("", "glfw", "glx") and not os.environ.get("DISPLAY"):
        raise RuntimeError(
            "mujoco was imported before MUJOCO_GL was set and there is no display to render to: "
            "set MUJOCO_GL=egl in the environment, or import relayrl.envs first"
        )


def instruction_for(task: str) -> str:
    """The language instruction of a Meta-World task name."""
    return INSTRUCTIONS.get(task, task.removesuffix("-v3").replace("-", " "))


class MetaWorldEnv:
    """One or more Meta-World tasks; each episode samples one of the task's 50 goal variations.

    ``tasks`` is a task name (``"reach-v3"``), a sequence of them, or ``"MT10"`` for the ten MT10
    tasks. ``cameras`` are MuJoCo camera names (``corner``, ``corner2``, ``corner3``, ``corner4``,
    ``topview``, ``behindGripper``, ``gripperPOV``), one image each. ``max_steps`` overrides the
    500-step path length. With ``terminate_on_success`` the episode ends the first step
    ``info["success"]`` is set; otherwise it runs to the time limit and ``success`` is the last
    step's flag. The reward is Meta-World's dense shaped reward (0 to 10).
    """

    def __init__(
        self,
        tasks: str | Sequence[str] = "reach-v3",
        *,
        image_size: int = 64,
        cameras: Sequence[str] = ("corner",),
        max_steps: int | None = None,
        terminate_on_success: bool = True,
        seed: int = 0,
    ) -> None:
        try:
            import metaworld
        except ImportError as e:
            raise ImportError(_MISSING) from e
        ensure_headless_gl()
        names = MT10 if tasks == "MT10" else (tasks,) if isinstance(tasks, str) else tuple(tasks)
        unknown = [t for t in names if t not in metaworld.ALL_V3_ENVIRONMENTS]
        if not names or unknown:
            raise ValueError(
                f"tasks must be 'MT10' or Meta-World v3 task names such as 'reach-v3', got "
                f"{tasks!r} (unknown: {unknown}); known: {sorted(metaworld.ALL_V3_ENVIRONMENTS)}"
            )
        if not 1 <= image_size <= 480:
            raise ValueError(
                f"image_size must be in [1, 480] (MuJoCo's offscreen size), got {image_size}"
            )
        if not cameras:
            raise ValueError("cameras must name at least one camera, got none")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be a positive int or None, got {max_steps}")
        self.tasks: tuple[str, ...] = names
        self.action_space = ActionSpace("continuous", 4, (-1.0,) * 4, (1.0,) * 4, bins=256)
        self.image_size, self.cameras = image_size, tuple(cameras)
        self.max_steps, self.terminate_on_success, self.seed = max_steps, terminate_on_success, seed
        self._rng = np.random.default_rng(seed)
        self._sims: dict[str, _Sim] = {}
        self._task = names[0]
        self._steps = 0

    def reset(self, *, task: str | None = None, seed: int | None = None) -> Observation:
        """Start an episode of ``task`` (a member of ``tasks``; None picks the first) with a goal
        variation drawn from the env's random stream (reseeded by ``seed``)."""
        task = self.tasks[0] if task is None else task
        if task not in self.tasks:
            raise ValueError(f"task {task!r} is not one of this env's tasks {self.tasks}")
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        if task not in self._sims:
            self._sims[task] = _Sim(task, self)
        sim = self._sims[task]
        sim.env.set_task(sim.variations[self._rng.integers(len(sim.variations))])
        sim.env.reset()
        self._task, self._steps = task, 0
        return self._observation()

    def step(self, action: np.ndarray | int) -> StepResult:
        """Apply one action: 4 floats in [-1, 1] (xyz move, gripper), clipped to that box."""
        action = np.clip(np.asarray(action, np.float32).reshape(-1), -1.0, 1.0)
        if action.shape != (4,):
            raise ValueError(f"action must have 4 values, got shape {action.shape}")
        _, reward, _, truncated, info = self._sims[self._task].env.step(action)
        self._steps += 1
        success = bool(info["success"])
        terminated = success and self.terminate_on_success
        return StepResult(
            obs=self._observation(),
            reward=float(reward),
            terminated=terminated,
            truncated=bool(truncated) and not terminated,
            success=success,
        )

    def close(self) -> None:
        """Release the renderers and simulators (renderers first: they hold GL contexts)."""
        for sim in self._sims.values():
            sim.close()
        self._sims.clear()

    def _observation(self) -> Observation:
        """Render every camera of the current task into an ``Observation``."""
        image = self._sims[self._task].render(self.cameras)
        return Observation(image, instruction_for(self._task), self._task, self._steps)


class _Sim:
    """One task's simulator, its goal variations and a fast offscreen renderer."""

    def __init__(self, task: str, owner: MetaWorldEnv) -> None:
        import metaworld
        import mujoco

        self._mujoco = mujoco
        benchmark = metaworld.MT1(task, seed=owner.seed)
        self.variations: list[Any] = benchmark.train_tasks
        self.env = benchmark.train_classes[task]()
        if owner.max_steps is not None:
            self.env.max_path_length = owner.max_steps
        model = self.env.model
        names = [model.camera(i).name for i in range(model.ncam)]
        missing = [c for c in owner.cameras if c not in names]
        if missing:
            raise ValueError(f"cameras {missing} are not in {task}; it has {names}")
        model.vis.quality.offsamples = 0  # read when the GL context is made, so set it first
        self.renderer = mujoco.Renderer(model, owner.image_size, owner.image_size)
        self.renderer.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
        self.renderer.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0

    def render(self, cameras: tuple[str, ...]) -> np.ndarray:
        """uint8 [len(cameras), H, W, 3] images of the current state."""
        views = []
        for camera in cameras:
            self.renderer.update_scene(self.env.data, camera=camera)
            pixels = self.renderer.render()
            views.append(pixels[::-1] if camera.startswith("corner") else pixels)
        return np.stack(views)

    def close(self) -> None:
        """Free the GL context, then the simulator."""
        self.renderer.close()
        self.env.close()
