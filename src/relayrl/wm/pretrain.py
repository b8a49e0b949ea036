"""``relayrl wm pretrain``: train M_obs and M_reward on collected episodes, with held-out
episodes, and save both where ``world_model.path`` loads them.

Episodes (not transitions) are split, so no held-out frame was seen in training. Each step
trains M_obs on ``batch_size`` transitions (K-frame contexts, padded at an episode's start as
``context_window`` pads) and M_reward on ``batch_size`` frames, half of them success frames (the
last frame of a successful episode) and half not: a success frame is one in tens, and a balanced
batch keeps the classifier from answering "never". With the failure head a quarter are success
frames and a quarter failure frames (the last frame of an episode the env ended without success),
while the data holds any. Writes into OUT::

    observation/   reward/     save_pretrained folders (model.safetensors + config.json)
    metrics.jsonl              losses, and the held-out measurements every eval_every steps
    pretrain.json              the report: data, split, sizes, time, held-out before and after
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from relayrl.config import Config
from relayrl.data.trajectories import Episode, load_episodes, read_manifest
from relayrl.executors.trainer_core import GradientStep
from relayrl.models.world_model import (
    ObservationModel,
    SuccessModel,
    Transitions,
    build_obs_model,
    save_pretrained,
    world_model_configs,
)
from relayrl.models.world_model.batches import (
    FAILURE,
    OTHER,
    SUCCESS,
    draw_frames,
    frame_index,
    labels,
    transition_index,
    transitions,
)

HELDOUT_TRANSITIONS = 256
"""Held-out transitions the observation model is measured on during pretraining."""
HELDOUT_FRAMES = 1024
"""Held-out frames the success model is measured on during pretraining (all success and failure
frames, the rest drawn from the others)."""


@dataclass
class Dataset:
    """Episodes of one or more trajectory folders, each tagged with its folder and index."""

    episodes: list[Episode]
    keys: list[tuple[str, int]]  # (resolved folder, episode index in it)
    manifests: dict[str, dict[str, Any]]


def load_dataset(folders: list[str]) -> Dataset:
    """Every episode of ``folders``; a ValueError when their frames or actions differ in shape."""
    episodes, keys, manifests = [], [], {}
    for folder in folders:
        name = str(Path(folder).resolve())
        manifests[name] = read_manifest(folder)
        for i, episode in enumerate(load_episodes(folder)):
            episodes.append(episode)
            keys.append((name, i))
    shapes = {(e.frames.shape[1:], e.actions.shape[1]) for e in episodes}
    if len(shapes) > 1:
        raise ValueError(f"--data: the folders' frames and actions differ in shape: {shapes}")
    if not episodes:
        raise ValueError(f"--data {folders}: no episodes")
    return Dataset(episodes, keys, manifests)


def model_configs(cfg: Config, data: Dataset) -> tuple:
    """Both models' configs for the config's world_model section and the data's frames and
    actions; a ValueError when the data does not fit the config."""
    first = data.episodes[0]
    views, height, width, _ = first.frames.shape[1:]
    if height != cfg.env.image_size or width != cfg.env.image_size:
        raise ValueError(
            f"env.image_size={cfg.env.image_size}, but the episodes' frames are "
            f"{height}x{width}: collect with the same env.image_size"
        )
    spaces = {json.dumps(m["producer"]["action_space"]) for m in data.manifests.values()}
    if len(spaces) > 1:
        raise ValueError(f"--data: the folders were collected with different actions: {spaces}")
    space = json.loads(spaces.pop())
    return world_model_configs(
        cfg.world_model,
        image_size=cfg.env.image_size,
        instruction_tokens=cfg.vla.instruction_tokens,
        views=views,
        dims=space["dims"],
        vocab=space["vocab"],
    )


def split(n: int, heldout: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Episode indices (train, held out): a seeded shuffle, ``heldout`` of them (at least one)
    held out."""
    if not 0 < heldout < 1:
        raise ValueError(f"--heldout must be in (0, 1), got {heldout}")
    if n < 2:
        raise ValueError(f"--data holds {n} episode; a held-out split needs at least 2")
    order = np.random.default_rng(seed).permutation(n)
    cut = min(n - 1, max(1, round(heldout * n)))
    return np.sort(order[cut:]), np.sort(order[:cut])


def heldout_head(name: str, logits: torch.Tensor, positive: torch.Tensor) -> dict[str, Any]:
    """Held-out BCE and accuracy (all, positives, others) of one reward-model head's logits."""
    target = positive.bool()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, target.float())
    correct = ((logits > 0) == target).float()
    return {
        f"heldout/{name}_bce": float(bce),
        f"heldout/{name}_acc": float(correct.mean()),
        f"heldout/{name}_acc_{'success' if name == 'reward' else name}": (
            float(correct[target].mean()) if target.any() else None
        ),
        f"heldout/{name}_acc_other": float(correct[~target].mean()),
    }


@torch.no_grad()
def frame_mse(model: ObservationModel, batch: Transitions, generator: torch.Generator) -> Any:
    """Per-transition pixel MSE [N] (pixels in [0, 1]) of the model's predictions and of copying
    the last context frame, in chunks of 64."""
    predicted, copied = [], []
    for start in range(0, len(batch.context), 64):
        context = batch.context[start : start + 64].float() / 255
        target = batch.next_frame[start : start + 64].float() / 255
        pred = model.predict(context, batch.actions[start : start + 64], generator=generator)
        predicted.append(((pred - target) ** 2).flatten(1).mean(1))
        copied.append(((context[:, -1] - target) ** 2).flatten(1).mean(1))
    return torch.cat(predicted), torch.cat(copied)


def psnr(mse: float) -> float:
    """Peak signal-to-noise ratio in dB of a mean squared error over pixels in [0, 1]."""
    return float(10 * np.log10(1.0 / max(mse, 1e-12)))


def pretrain(
    cfg: Config,
    data: list[str],
    out: str | Path,
    *,
    steps: int,
    batch_size: int = 32,
    heldout: float = 0.1,
    eval_every: int | None = None,
    seed: int = 0,
    command: str = "",
) -> dict[str, Any]:
    """Train both models for ``steps`` steps on the episodes of ``data`` and save them into
    ``out``; returns the report it writes to ``out/pretrain.json``."""
    if steps < 1 or batch_size < 2:
        raise ValueError(f"--steps must be >= 1 and --batch-size >= 2, got {steps}, {batch_size}")
    eval_every = eval_every or max(1, steps // 10)
    if eval_every < 1:
        raise ValueError(f"--eval-every must be >= 1, got {eval_every}")
    out = Path(out)
    if out.is_dir() and any(out.iterdir()):
        raise FileExistsError(f"--out {out} is not empty; choose a new folder for the models")
    dataset = load_dataset(data)
    episodes = dataset.episodes
    obs_cfg, reward_cfg = model_configs(cfg, dataset)
    train_eps, held_eps = split(len(episodes), heldout, seed)
    train_tr = transition_index(episodes, train_eps)
    train_frames, train_outcome = frame_index(episodes, train_eps)
    if not (train_outcome == SUCCESS).any():
        raise ValueError(
            f"--data: none of the {len(train_eps)} training episodes succeeded, so the reward "
            "model has no success frame to learn from; collect some with --policy noisy_scripted"
        )

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    obs_model = build_obs_model(obs_cfg)
    reward_model = SuccessModel(reward_cfg)
    # The run's world-model trainer steps alike: AdamW (its default decay), no clipping, and a
    # nan or inf loss or gradient norm skips the step (counted in the report).
    obs_step = GradientStep(obs_model, lr=cfg.world_model.lr, weight_decay=0.01)
    reward_step = GradientStep(reward_model, lr=cfg.world_model.lr, weight_decay=0.01)

    held_tr = transition_index(episodes, held_eps)
    held_tr = held_tr[np.sort(rng.permutation(len(held_tr))[:HELDOUT_TRANSITIONS])]
    held_batch = transitions(episodes, held_tr, obs_cfg.context_frames)
    held_frames, held_outcome = frame_index(episodes, held_eps)
    keep = (held_outcome != OTHER) | (
        rng.random(len(held_frames)) < HELDOUT_FRAMES / len(held_frames)
    )
    held_labels = labels(reward_model, episodes, held_frames[keep], held_outcome[keep])

    def measure(step: int) -> dict[str, float]:
        obs_model.eval()
        reward_model.eval()
        mse, copy = frame_mse(obs_model, held_batch, torch.Generator().manual_seed(seed))
        with torch.no_grad():
            logits = reward_model.logits(held_labels.frames, held_labels.instruction_ids)
        obs_model.train()
        reward_model.train()
        return {
            "step": step,
            "heldout/obs_mse": float(mse.mean()),
            "heldout/obs_psnr": psnr(float(mse.mean())),
            "heldout/copy_last_mse": float(copy.mean()),
            **heldout_head("reward", logits[:, 0], held_labels.success),
            **(
                heldout_head("failure", logits[:, 1], held_labels.failure)
                if held_labels.failure is not None
                else {}
            ),
        }

    out.mkdir(parents=True, exist_ok=True)
    log = (out / "metrics.jsonl").open("w", buffering=1)  # line-buffered: readable mid-run
    curve = [measure(0)]
    log.write(json.dumps(curve[0]) + "\n")
    start = time.perf_counter()
    bar = tqdm(range(1, steps + 1), desc="pretrain", unit="step", disable=not cfg.log.progress)
    for step in bar:
        batch = transitions(
            episodes, train_tr[rng.integers(len(train_tr), size=batch_size)], obs_cfg.context_frames
        )
        obs_loss = obs_model.loss(batch)
        obs_step.step(obs_loss)

        drawn = draw_frames(train_frames, train_outcome, batch_size, rng, reward_cfg.failure_head)
        if drawn is None:  # success frames were checked above; first frames are others
            raise RuntimeError("the training episodes hold no frame that ends no episode")
        reward_loss = reward_model.loss(labels(reward_model, episodes, *drawn))
        reward_step.step(reward_loss)

        row: dict[str, Any] = {
            "step": step,
            "loss/obs": obs_loss.item(),
            "loss/reward": reward_loss.item(),
        }
        if step % eval_every == 0 or step == steps:
            measured = measure(step)
            curve.append(measured)
            row |= measured
            bar.write(
                f"step {step}: held-out obs MSE {measured['heldout/obs_mse']:.5f} "
                f"(copy-last {measured['heldout/copy_last_mse']:.5f}), reward acc "
                f"{measured['heldout/reward_acc']:.3f}"
            )
        log.write(json.dumps(row) + "\n")
        bar.set_postfix(
            obs=f"{obs_loss.item():.4f}", reward=f"{reward_loss.item():.3f}", refresh=False
        )
    log.close()
    seconds = time.perf_counter() - start

    save_pretrained(obs_model, out / "observation", version=steps)
    save_pretrained(reward_model, out / "reward", version=steps)
    heldout_keys: dict[str, list[int]] = {}
    for e in held_eps:
        folder, index = dataset.keys[e]
        heldout_keys.setdefault(folder, []).append(index)
    report = {
        "command": command,
        "data": list(dataset.manifests),
        "collected_by": {k: m["producer"] for k, m in dataset.manifests.items()},
        "backend": obs_cfg.backend,
        "parameters": {
            "observation": sum(p.numel() for p in obs_model.parameters()),
            "reward": sum(p.numel() for p in reward_model.parameters()),
        },
        "steps": steps,
        "batch_size": batch_size,
        "seed": seed,
        "seconds": seconds,
        "split": {
            "heldout_fraction": heldout,
            "train_episodes": len(train_eps),
            "heldout_episodes": len(held_eps),
            "train_transitions": len(train_tr),
            "train_success_frames": int((train_outcome == SUCCESS).sum()),
            "train_failure_frames": int((train_outcome == FAILURE).sum()),
            "heldout": heldout_keys,
        },
        "final_losses": {"obs": obs_loss.item(), "reward": reward_loss.item()},
        "skipped_nonfinite": {
            "obs": obs_step.skipped_nonfinite,
            "reward": reward_step.skipped_nonfinite,
        },
        "heldout_start": curve[0],
        "heldout_end": curve[-1],
        "curve": curve,
    }
    (out / "pretrain.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
