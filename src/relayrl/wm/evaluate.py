"""``relayrl wm eval``: how good a world model is, measured on real episodes it never trained on.

- Observation model: per-step pixel MSE and PSNR (predicting o_{t+1} from the real context) and
  the error of an open-loop rollout over ``horizon`` steps (the real actions, the model's own
  frames as context), each beside copying the last real frame.
- Success model: accuracy (at 0.5 and at ``world_model.threshold``) and AUC over every frame,
  a frame being a success when it ends a successful episode; with the failure head the same for
  failure frames (the last frame of an episode the env ended without success) at
  ``world_model.failure_threshold``.
- One fixed policy's success rate in imagination (``imagine`` from each episode's real first
  frame, ended by ``imagined_termination``) against the real env from the same start (the
  episode's level and reset seed), both capped at ``world_model.max_steps`` steps; and how often
  each ended in failure before the cap. ``frame_strip`` draws the first few of those episodes,
  real above imagined, frame by frame: what per-step error hides (objects that vanish from
  imagined frames) shows there.

Episodes of a folder the world model was pretrained on count only if pretraining held them out
(``pretrain.json`` lists them); episodes of any other folder all count.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from relayrl.config import Config
from relayrl.data.trajectories import Episode
from relayrl.executors.worker_side import ENVS
from relayrl.models.world_model import (
    ObservationModel,
    SuccessModel,
    context_window,
    imagine,
    load_pretrained,
    start_context,
)
from relayrl.wm.collect import play_episode
from relayrl.wm.policies import CheckpointPolicy, RandomPolicy
from relayrl.wm.pretrain import (
    FAILURE,
    SUCCESS,
    frame_index,
    frame_mse,
    load_dataset,
    psnr,
    transition_index,
    transitions,
)


def load_world_model(path: str | Path) -> tuple[ObservationModel, SuccessModel]:
    """The observation and success models of a ``relayrl wm pretrain`` folder (``observation/``
    and ``reward/``), what ``world_model.path`` names."""
    folder = Path(path)
    for part in ("observation", "reward"):
        if not (folder / part / "config.json").is_file():
            raise FileNotFoundError(
                f"--world-model {path}: no {part}/config.json; expected a folder written by "
                "relayrl wm pretrain"
            )
    obs, reward = load_pretrained(folder / "observation"), load_pretrained(folder / "reward")
    if not isinstance(obs, ObservationModel) or not isinstance(reward, SuccessModel):
        raise ValueError(f"--world-model {path}: observation/ and reward/ hold the wrong models")
    return obs.eval(), reward.eval()


def auc(scores: np.ndarray, positive: np.ndarray) -> float | None:
    """Area under the ROC curve by ranks (Mann-Whitney U, ties share their mean rank); None
    when one class is absent."""
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    mean_rank = np.cumsum(counts) - (counts - 1) / 2
    ranks = mean_rank[inverse]
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def select_episodes(
    data: list[str], wm_path: str | Path, limit: int
) -> tuple[list[Episode], dict[str, str]]:
    """Up to ``limit`` evaluation episodes of ``data`` and, per folder, which ones counted."""
    dataset = load_dataset(data)
    report_path = Path(wm_path) / "pretrain.json"
    pretrained = json.loads(report_path.read_text()) if report_path.is_file() else {}
    heldout = {k: set(v) for k, v in pretrained.get("split", {}).get("heldout", {}).items()}
    trained_on = set(pretrained.get("data", []))
    chosen, sources = [], {}
    for episode, (folder, index) in zip(dataset.episodes, dataset.keys, strict=True):
        if folder in trained_on:
            sources[folder] = "held-out episodes of the pretraining data"
            if index not in heldout.get(folder, set()):
                continue
        else:
            sources.setdefault(folder, "all episodes (not pretrained on)")
        chosen.append(episode)
    if not chosen:
        raise ValueError(f"--data {data}: no episode the world model did not train on")
    return chosen[:limit], sources


@torch.no_grad()
def rollout_errors(
    model: ObservationModel, episodes: list[Episode], horizon: int, rng, generator
) -> dict[str, Any]:
    """Open-loop rollouts of ``horizon`` steps from a random step of every episode that long:
    the model's MSE at each horizon and copying the start frame's."""
    k = model.cfg.context_frames
    long = [e for e in episodes if e.steps >= horizon]
    if not long:
        return {"episodes": 0, "mse": None, "copy_mse": None}
    pairs = [(e, int(rng.integers(0, e.steps - horizon + 1))) for e in long]
    windows = [context_window(e.frames, e.actions, t, k)[0] for e, t in pairs]
    context = torch.from_numpy(np.stack(windows)).float() / 255
    first = context[:, -1]
    mse, copy = [], []
    for h in range(horizon):
        actions = torch.from_numpy(
            np.stack([context_window(e.frames, e.actions, t + h, k)[1] for e, t in pairs])
        )
        pred = model.predict(context, actions, generator=generator)
        real = torch.from_numpy(np.stack([e.frames[t + h + 1] for e, t in pairs]))
        real = real.float() / 255
        mse.append(float(((pred - real) ** 2).mean()))
        copy.append(float(((first - real) ** 2).mean()))
        context = torch.cat([context[:, 1:], pred[:, None]], dim=1)
    return {"episodes": len(long), "mse": mse, "copy_mse": copy}


@torch.no_grad()
def success_scores(
    model: SuccessModel, episodes: list[Episode], threshold: float, fail_threshold: float
) -> dict:
    """The success model's accuracy and AUC over every frame of ``episodes``; with the failure
    head, the same for failure frames under ``"failure"`` (else None there)."""
    index, outcome = frame_index(episodes, np.arange(len(episodes)))
    success, failure = [], []
    for start in range(0, len(index), 256):
        rows = index[start : start + 256]
        frames = torch.from_numpy(np.stack([episodes[e].frames[t] for e, t in rows]))
        ids = model.tokenize([episodes[e].instruction for e, _ in rows])
        p, f = model.probs(frames, ids)
        success.append(p.numpy())
        failure.append(f.numpy())
    scores = head_scores(np.concatenate(success), outcome == SUCCESS, threshold, "success")
    scores["failure"] = (
        head_scores(np.concatenate(failure), outcome == FAILURE, fail_threshold, "failure")
        if model.cfg.failure_head
        else None
    )
    return scores


def head_scores(p: np.ndarray, positive: np.ndarray, threshold: float, name: str) -> dict:
    """Accuracy (at 0.5 and at ``threshold``), rates at the threshold, AUC and mean
    probabilities of one head's probabilities ``p`` [N] against ``positive`` bool [N]."""
    at = p >= threshold

    def rate(mask: np.ndarray) -> float | None:
        return float(mask.mean()) if len(mask) else None

    return {
        "frames": len(p),
        f"{name}_frames": int(positive.sum()),
        "accuracy": float(((p >= 0.5) == positive).mean()),
        "accuracy_at_threshold": float((at == positive).mean()),
        "true_positive_rate_at_threshold": rate(at[positive]),
        "true_negative_rate_at_threshold": rate(~at[~positive]),
        "auc": auc(p, positive),
        f"mean_prob_{name}": rate(p[positive]) if positive.any() else None,
        "mean_prob_other": float(p[~positive].mean()),
    }


def evaluate(
    cfg: Config,
    world_model: str | Path,
    data: list[str],
    *,
    policy: str = "random",
    episodes: int = 32,
    horizon: int = 10,
    seed: int = 0,
    command: str = "",
    strip_path: str | Path | None = None,
) -> dict[str, Any]:
    """Measure the world model in ``world_model`` on the episodes of ``data`` (see the module
    doc); returns the report, and writes the policy's ``frame_strip`` to ``strip_path`` (PNG)
    if given."""
    if episodes < 1 or horizon < 1:
        raise ValueError(f"--episodes and --horizon must be >= 1, got {episodes}, {horizon}")
    obs_model, reward_model = load_world_model(world_model)
    chosen, sources = select_episodes(data, world_model, episodes)
    frame = chosen[0].frames.shape[1:]
    if (obs_model.cfg.views, obs_model.cfg.image_size) != (frame[0], frame[1]):
        raise ValueError(
            f"--world-model {world_model} predicts {obs_model.cfg.views} view(s) of "
            f"{obs_model.cfg.image_size} pixels, the episodes have {frame[0]} of {frame[1]}"
        )
    wm = cfg.world_model
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    bar = tqdm(total=4, desc="wm eval", unit="part", disable=not cfg.log.progress)

    index = transition_index(chosen, np.arange(len(chosen)))
    batch = transitions(chosen, index, obs_model.cfg.context_frames)
    mse, copy = frame_mse(obs_model, batch, generator)
    per_step = {
        "transitions": len(index),
        "mse": float(mse.mean()),
        "psnr": psnr(float(mse.mean())),
        "copy_last_mse": float(copy.mean()),
        "copy_last_psnr": psnr(float(copy.mean())),
    }
    bar.update()
    rollout = rollout_errors(obs_model, chosen, horizon, rng, generator)
    if rollout["mse"] is not None:
        rollout["psnr_at_horizon"] = psnr(rollout["mse"][-1])
        rollout["copy_psnr_at_horizon"] = psnr(rollout["copy_mse"][-1])
    bar.update()
    success = success_scores(reward_model, chosen, wm.threshold, wm.failure_threshold)
    bar.update()
    play, strip = policy_success(cfg, obs_model, reward_model, chosen, policy, seed, generator)
    if strip_path is not None:
        import matplotlib.image

        matplotlib.image.imsave(strip_path, strip)
    bar.update()
    bar.close()
    return {
        "command": command,
        "world_model": str(Path(world_model).resolve()),
        "backend": obs_model.cfg.backend,
        "data": sources,
        "episodes": len(chosen),
        "observation": {"per_step": per_step, "rollout": {"horizon": horizon, **rollout}},
        "reward": success,
        "policy": play,
    }


def policy_success(
    cfg: Config,
    obs_model: ObservationModel,
    reward_model: SuccessModel,
    episodes: list[Episode],
    policy: str,
    seed: int,
    generator: torch.Generator,
) -> tuple[dict[str, Any], np.ndarray]:
    """The success rate of ``policy`` (random or a VLA checkpoint folder) in imagination and in
    the real env, from the start of each of ``episodes``, capped at world_model.max_steps; and
    the ``frame_strip`` of the first episodes, real above imagined."""
    wm = cfg.world_model
    env = ENVS[cfg.env.name](
        cfg.env.model_copy(update={"tasks": sorted({e.task for e in episodes})}), seed
    )
    actor: RandomPolicy | CheckpointPolicy
    if policy == "random":
        actor = RandomPolicy(env.action_space, seed)
    else:
        actor = CheckpointPolicy(policy, seed)
    k = obs_model.cfg.context_frames
    starts = [start_context(e.frames, e.actions, 0, k) for e in episodes]
    imagined = imagine(
        obs_model,
        reward_model,
        actor,
        torch.from_numpy(np.stack([s[0] for s in starts])),
        torch.from_numpy(np.stack([s[1] for s in starts])),
        [e.instruction for e in episodes],
        threshold=wm.threshold,
        max_steps=wm.max_steps,
        terminal_reward=wm.terminal_reward,
        fail_threshold=wm.failure_threshold,
        generator=generator,
    )
    real, same_start = [], 0
    try:
        for e in episodes:
            played = play_episode(env, actor, task=e.task, seed=e.seed, max_steps=wm.max_steps)
            same_start += bool(np.array_equal(played.frames[0], e.frames[0]))
            real.append(played)
    finally:
        env.close()
    real_success = np.array([r.success for r in real])
    imagined_success = imagined.success.numpy()
    lengths = imagined.lengths.numpy()
    pairs = [(r.frames, imagined.frames[i, : lengths[i] + 1].numpy()) for i, r in enumerate(real)]
    report = {
        "policy": policy,
        "episodes": len(episodes),
        "max_steps": wm.max_steps,
        "threshold": wm.threshold,
        "imagined_success": float(imagined_success.mean()),
        "real_success": float(real_success.mean()),
        "gap": float(imagined_success.mean() - real_success.mean()),
        "outcome_agreement": float((imagined_success == real_success).mean()),
        "imagined_mean_length": float(imagined.lengths.float().mean()),
        "real_mean_length": float(np.mean([r.steps for r in real])),
        "failure_threshold": wm.failure_threshold if reward_model.cfg.failure_head else None,
        "real_failed_early": float(np.mean([r.terminated and not r.success for r in real])),
        "imagined_failed_early": float(imagined.failure.float().mean()),
        "imagined_return": float(imagined.rewards.sum(1).mean()),
        "same_start_frames": same_start / len(episodes),
    }
    return report, frame_strip(pairs)


def frame_strip(
    pairs: list[tuple[np.ndarray, np.ndarray]], rows: int = 4, steps: int = 12
) -> np.ndarray:
    """One image of up to ``rows`` episode pairs (real frames uint8 [T + 1, V, H, W, 3], imagined
    frames of the same start): each pair is two rows of its first ``steps`` frames, real above
    imagined, the views of a frame stacked top to bottom; black after an episode ended, grey
    lines between frames and pairs. Returns uint8 [height, width, 3]."""
    if not pairs:
        raise ValueError("frame_strip needs at least one pair of episodes")
    views, height, width, _ = pairs[0][0].shape[1:]
    cell_h, gap = views * height, 1
    chosen = pairs[:rows]
    out = np.full((len(chosen) * 2 * (cell_h + gap), steps * (width + gap), 3), 128, np.uint8)
    for row, pair in enumerate(chosen):
        for half, frames in enumerate(pair):
            top = row * (2 * cell_h + 2 * gap) + half * cell_h
            for t in range(steps):
                left = t * (width + gap)
                cell = np.zeros((cell_h, width, 3), dtype=np.uint8)
                if t < len(frames):
                    cell = np.concatenate(list(frames[t]), axis=0)
                out[top : top + cell_h, left : left + width] = cell
    return out


def format_report(report: dict[str, Any]) -> str:
    """The report as a few readable lines."""
    obs, rew, play = report["observation"], report["reward"], report["policy"]
    step, roll = obs["per_step"], obs["rollout"]
    lines = [
        f"world model {report['world_model']} ({report['backend']}), "
        f"{report['episodes']} real episodes:",
        *(f"  {folder}: {source}" for folder, source in report["data"].items()),
        f"per-step prediction ({step['transitions']} transitions): MSE {step['mse']:.5f}, "
        f"PSNR {step['psnr']:.2f} dB (copy last frame: MSE {step['copy_last_mse']:.5f}, "
        f"PSNR {step['copy_last_psnr']:.2f} dB)",
    ]
    if roll["mse"] is None:
        lines.append(f"{roll['horizon']}-step rollout: no episode has {roll['horizon']} steps")
    else:
        lines.append(
            f"{roll['horizon']}-step rollout ({roll['episodes']} episodes): MSE at step "
            f"{roll['horizon']} {roll['mse'][-1]:.5f}, PSNR {roll['psnr_at_horizon']:.2f} dB "
            f"(copy start frame: {roll['copy_mse'][-1]:.5f}, {roll['copy_psnr_at_horizon']:.2f} "
            f"dB); MSE by step: {' '.join(f'{m:.4f}' for m in roll['mse'])}"
        )
    for name, head in (("success", rew), ("failure", rew["failure"])):
        if head is None:
            lines.append("failure head: none (world_model.failure_head was off in pretraining)")
            continue
        auc_text = "n/a (one class only)" if head["auc"] is None else f"{head['auc']:.3f}"
        lines.append(
            f"{name} head ({head['frames']} frames, {head[f'{name}_frames']} {name}): accuracy "
            f"{head['accuracy']:.3f} at 0.5, {head['accuracy_at_threshold']:.3f} at the "
            f"threshold; AUC {auc_text}"
        )
    lines.append(
        f"policy {play['policy']} over {play['episodes']} starts (cap {play['max_steps']} steps): "
        f"success {play['imagined_success']:.3f} imagined vs {play['real_success']:.3f} real "
        f"(gap {play['gap']:+.3f}, same outcome {play['outcome_agreement']:.3f}); mean length "
        f"{play['imagined_mean_length']:.1f} imagined vs {play['real_mean_length']:.1f} real; "
        f"failed before the cap {play['imagined_failed_early']:.3f} imagined vs "
        f"{play['real_failed_early']:.3f} real"
    )
    return "\n".join(lines)
