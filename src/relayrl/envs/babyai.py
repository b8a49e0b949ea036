"""BabyAI (minigrid) behind ``EmbodiedEnv``: an RGB image and the mission string.

The image is the agent's egocentric 7 x 7-cell view (``view="egocentric"``, minigrid's
``RGBImgPartialObsWrapper``), or the whole grid from above (``view="full"``, minigrid's
``RGBImgObsWrapper`` without the view-cone highlight): every object stays in the frame whichever
way the agent faces, so a pixel world model never has to imagine what lies outside the view. With
``view="both"`` the image has two views, ``[2, H, W, 3]``: the egocentric one first, then the full
one (what a world model can predict from, beside what the agent's success is judged on). The
full view draws cells at the egocentric view's scale (``image_size`` / 7 pixels), whatever the
level set, so frames of every level and run share one scale; a grid smaller than 7 cells is padded
on the bottom and right with black, and a level whose grid is larger is refused.

The distractor rule. In plain BabyAI GoTo levels the episode does not end when the agent faces a
wrong object, so an agent that ignores the instruction and visits the objects in turn reaches close
to 100% success. With ``distractor_fails=True`` the episode ends as a failure (``terminated=True``,
``success=False``, reward 0) as soon as, after a step, the cell in front of the agent holds a ball,
box or key that is not a target of the mission. Doors and walls never count as distractors (the
agent has to face doors to walk through them). Success is minigrid's own: in GoTo levels the agent
succeeds the step it faces a target object, with no ``done`` action, so three actions (turn left,
turn right, move forward) suffice.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from relayrl.envs.embodied import ActionSpace, Observation, StepResult

VIEWS = ("egocentric", "full", "both")
"""What ``view`` may be: the agent's 7 x 7-cell view, the whole grid from above, or both (two
views, the egocentric one first)."""

# Objects that can be the target of a GoTo mission and therefore can be the wrong one.
_DISTRACTOR_TYPES = ("ball", "box", "key")
_MISSING = 'BabyAI needs minigrid: pip install "relayrl[babyai]"'


class BabyAIEnv:
    """One or more BabyAI levels with RGB observations (``view``) and the distractor rule.

    ``level`` is a level id or a sequence of them; ``tasks`` lists them in that order and
    ``reset(task=...)`` picks one. ``image_size`` must be a multiple of the 7-cell view (7 x tile
    pixels), and with ``view`` "full" or "both" every level's grid must fit in 7 cells;
    ``max_steps`` overrides minigrid's per-level episode limit; ``seed`` seeds each level's first
    episode (later episodes continue that random stream unless ``reset`` gets a seed).
    """

    def __init__(
        self,
        level: str | Sequence[str] = "BabyAI-GoToLocalS7N4-v0",
        *,
        image_size: int = 56,
        distractor_fails: bool = True,
        max_steps: int | None = None,
        view: str = "egocentric",
        seed: int = 0,
    ) -> None:
        try:
            import gymnasium as gym
            import minigrid  # noqa: F401  (registers the BabyAI level ids)
            from minigrid.envs.babyai.core import verifier
            from minigrid.envs.babyai.core.verifier import GoToInstr
            from minigrid.wrappers import RGBImgObsWrapper, RGBImgPartialObsWrapper
        except ImportError as e:
            raise ImportError(_MISSING) from e
        if verifier.use_done_actions:
            raise ValueError(
                "BABYAI_DONE_ACTIONS is set, so GoTo success would need a 'done' action that the "
                "3-action space lacks; unset it"
            )
        levels = (level,) if isinstance(level, str) else tuple(level)
        if not levels:
            raise ValueError("level must name at least one BabyAI level, got an empty sequence")
        if view not in VIEWS:
            raise ValueError(f"view must be one of {', '.join(VIEWS)}, got {view!r}")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be a positive int or None, got {max_steps}")
        self.tasks: tuple[str, ...] = levels
        self.action_space = ActionSpace("discrete", 3)
        self.distractor_fails = distractor_fails
        self._goto = GoToInstr
        self._envs: dict[str, Any] = {}
        bases = {}
        for name in levels:
            if name not in gym.registry:
                raise ValueError(f"level {name!r} is not a registered BabyAI/minigrid env id")
            kwargs = {} if max_steps is None else {"max_steps": max_steps}
            if view == "full":
                kwargs["highlight"] = False  # no view cone: the whole grid is the observation
            # Stdout is silenced here too: some levels generate a grid while they are constructed.
            with contextlib.redirect_stdout(io.StringIO()):
                bases[name] = gym.make(name, **kwargs)
        cells = max(b.unwrapped.agent_view_size for b in bases.values())
        if image_size <= 0 or image_size % cells:
            raise ValueError(
                f"image_size must be a positive multiple of the {cells}-cell view of "
                f"{', '.join(levels)}, got {image_size}"
            )
        if view != "egocentric":
            for name, base in bases.items():
                grid = max(base.unwrapped.width, base.unwrapped.height)
                if grid > cells:
                    raise ValueError(
                        f"view={view} draws the grid at the {cells}-cell view's scale; level "
                        f"{name} has a {grid}-cell grid, larger than the image: use "
                        "view=egocentric"
                    )
        wrapper = RGBImgObsWrapper if view == "full" else RGBImgPartialObsWrapper
        for name, base in bases.items():
            self._envs[name] = wrapper(base, tile_size=image_size // cells)
        self.image_size = image_size
        self._both = view == "both"
        self._tile = image_size // cells
        self._seeds = {name: seed + i for i, name in enumerate(levels)}
        self._task = levels[0]
        self._instruction = ""
        self._steps = 0

    def reset(self, *, task: str | None = None, seed: int | None = None) -> Observation:
        """Start an episode of ``task`` (a member of ``tasks``; None picks the first)."""
        task = self.tasks[0] if task is None else task
        if task not in self._envs:
            raise ValueError(f"task {task!r} is not one of this env's tasks {self.tasks}")
        if seed is None:
            seed = self._seeds.pop(task, None)
        self._task, self._steps = task, 0
        env = self._envs[task]
        # GoToLocal's rejection sampler prints "Sampling rejected" lines that would break progress
        # bars.
        with contextlib.redirect_stdout(io.StringIO()):
            obs, _ = env.reset(seed=seed)
        if self.distractor_fails and not isinstance(env.unwrapped.instrs, self._goto):
            raise ValueError(
                f"distractor_fails=True needs a single 'go to' mission; level {task!r} gave "
                f"{obs['mission']!r}: pass distractor_fails=False for it"
            )
        self._instruction = obs["mission"]
        return self._observation(obs)

    def step(self, action: np.ndarray | int) -> StepResult:
        """Apply one action: 0 turn left, 1 turn right, 2 move forward."""
        action = int(action)
        if not 0 <= action < self.action_space.n:
            raise ValueError(f"action must be 0 (left), 1 (right) or 2 (forward), got {action}")
        env = self._envs[self._task]
        obs, reward, terminated, truncated, _ = env.step(action)
        self._steps += 1
        success = bool(terminated) and reward > 0
        distractor = not success and self.distractor_fails and self._faces_distractor()
        if distractor:
            terminated, reward = True, 0.0
        return StepResult(
            obs=self._observation(obs),
            reward=float(reward),
            terminated=bool(terminated),
            truncated=bool(truncated) and not terminated,
            success=success,
            info={"distractor": distractor},
        )

    def expert(self) -> Any:
        """minigrid's ``BabyAIBot`` for the episode ``reset`` began: ``bot.replan(taken)`` suggests
        the next action after the agent took ``taken`` (None: the suggested one), so it keeps
        advising when another action was taken. A scripted demonstrator, e.g. for offline data."""
        from minigrid.utils.baby_ai_bot import BabyAIBot

        return BabyAIBot(self._envs[self._task])

    def close(self) -> None:
        """Release the minigrid envs."""
        for env in self._envs.values():
            env.close()

    def _faces_distractor(self) -> bool:
        """Whether the cell in front of the agent holds a ball, box or key the mission does not
        name."""
        env = self._envs[self._task].unwrapped
        cell = env.grid.get(*env.front_pos)
        if cell is None or cell.type not in _DISTRACTOR_TYPES:
            return False
        targets = env.instrs.desc.obj_poss
        return not any(np.array_equal(pos, env.front_pos) for pos in targets)

    def _observation(self, obs: dict[str, Any]) -> Observation:
        """A minigrid observation dict to an ``Observation`` with a [V, H, W, 3] image."""
        views = [self._padded(obs["image"])]
        if self._both:  # the wrapper drew the egocentric view; the full one is drawn here
            env = self._envs[self._task].unwrapped
            views.append(self._padded(env.get_frame(highlight=False, tile_size=self._tile)))
        return Observation(np.stack(views), self._instruction, self._task, self._steps)

    def _padded(self, frame: np.ndarray) -> np.ndarray:
        """``frame`` as uint8 [H, W, 3], a smaller grid's full view padded with black."""
        image = np.ascontiguousarray(frame, dtype=np.uint8)
        if image.shape[:2] != (self.image_size, self.image_size):
            padded = np.zeros((self.image_size, self.image_size, 3), dtype=np.uint8)
            padded[: image.shape[0], : image.shape[1]] = image
            image = padded
        return image
