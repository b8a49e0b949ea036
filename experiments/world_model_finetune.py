"""What online fine-tuning does to a pretrained world model, and to imagination on the target level.

Reads a ``benchmarks/world_model.py`` work folder (its ``start`` policy and ``offline`` model),
plays ``--episodes`` real S7N4 episodes with the start policy and hands the first ``--train``
of them to a ``WorldModelTrainer`` (the run's own executor, ``world_model.path`` = the offline
model), then runs its rounds as a run would (``world_model.train_steps`` steps of each model per
round). Every ``--every`` rounds it measures on the held-out rest of the episodes:

- M_obs: per-step PSNR (the real context) against copying the last frame;
- M_reward: success and failure AUC over every frame;
- imagination as the rollout workers play it (``WorldModelEnv``s over the world model's batch
  function, acted in by the start policy): the success rate, failed-before-the-cap rate and mean
  length of ``imagination.episodes_per_real`` imagined episodes after each held-out real episode
  (started from the last ``imagination.cache_episodes`` of them), beside the real success and
  failure rates of those episodes.

It writes ``experiments/results/world_model_finetune[_TAG].json`` and ``.png`` (the measures
against rounds), and a strip of imagined frames (4 held-out starts, 16 steps, before and after
fine-tuning, under the real episodes) as ``..._frames.png``.

    python benchmarks/world_model.py --work WORK ...   # phases start and offline first
    python experiments/world_model_finetune.py --work WORK env.image_size=28 vla.patch_size=4
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import provenance, relative, save_result, shrink_png  # noqa: E402

from relayrl.config import load_config  # noqa: E402
from relayrl.data.trajectories import Episode  # noqa: E402
from relayrl.envs.embodied import ActionSpace  # noqa: E402
from relayrl.envs.world_model_env import RealStarts, WorldModelEnv  # noqa: E402
from relayrl.executors.imagination import ImaginationSettings  # noqa: E402
from relayrl.executors.worker_side import ENVS  # noqa: E402
from relayrl.executors.world_model_trainer import WorldModelTrainer  # noqa: E402
from relayrl.models.world_model import imagine, start_context, world_model_configs  # noqa: E402
from relayrl.models.world_model.serving import world_model_replies  # noqa: E402
from relayrl.types import ActReply  # noqa: E402
from relayrl.wm.collect import play_episode  # noqa: E402
from relayrl.wm.evaluate import success_scores  # noqa: E402
from relayrl.wm.policies import CheckpointPolicy  # noqa: E402
from relayrl.wm.pretrain import frame_mse, psnr, transition_index, transitions  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ARM_CONFIG = REPO / "configs" / "babyai_wm.yaml"
NAME = "world_model_finetune"
STRIP_STARTS, STRIP_STEPS = 4, 16


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="a world_model.py work folder")
    parser.add_argument("--episodes", type=int, default=198, help="real target episodes played")
    parser.add_argument("--train", type=int, default=150, help="of them, given to B_wm")
    parser.add_argument("--rounds", type=int, default=10, help="world-model trainer rounds")
    parser.add_argument("--every", type=int, default=5, help="rounds between measurements")
    parser.add_argument("--seed", type=int, default=0, help="seed of play and imagination")
    parser.add_argument("--tag", default="", help="suffix of the result files")
    parser.add_argument("--out", type=Path, default=REPO / "experiments" / "results")
    parser.add_argument("overrides", nargs="*", help="a.b=value items, as world_model.py got")
    args = parser.parse_args(argv)
    if not 0 < args.train < args.episodes or min(args.rounds, args.every) < 1:
        parser.error("need 0 < --train < --episodes and --rounds, --every >= 1")
    return args


class _Service:
    """The start policy answering imagination's ``act_many`` as the inference service does."""

    def __init__(self, policy: CheckpointPolicy, seed: int):
        self.policy = policy.policy
        self.generator = torch.Generator().manual_seed(seed)

    def act_many(self, observations: list, worker: int, env_steps: int) -> list[ActReply]:
        """Sampled actions for ``observations``."""
        images = torch.from_numpy(np.stack([o.image for o in observations]))
        steps = torch.tensor([o.step for o in observations])
        with torch.no_grad():
            actions, logprobs, values = self.policy.act(
                images, [o.instruction for o in observations], steps, generator=self.generator
            )
        return [
            ActReply(actions[i].numpy(), logprobs[i].numpy(), float(values[i]), 0)
            for i in range(len(observations))
        ]


def measure(cfg, trainer: WorldModelTrainer, heldout: list[Episode], policy, seed: int) -> dict:
    """The world model's quality and imagination on the held-out episodes."""
    model, wm = trainer.model.eval(), cfg.world_model
    k = model.obs.cfg.context_frames
    index = transition_index(heldout, np.arange(len(heldout)))
    mse, copy = frame_mse(model.obs, transitions(heldout, index, k), torch.Generator())
    scores = success_scores(model.reward, heldout, wm.threshold, wm.failure_threshold)
    ended = imagined_episodes(cfg, model, heldout, _Service(policy, seed), seed)
    trainer.model.train()
    return {
        "psnr": psnr(float(mse.mean())),
        "copy_psnr": psnr(float(copy.mean())),
        "success_auc": scores["auc"],
        "failure_auc": (scores.get("failure") or {}).get("auc"),
        "imagined_episodes": len(ended),
        "imagined_success": float(np.mean([r.success for r in ended])),
        "imagined_failed_early": float(np.mean([r.terminated and not r.success for r in ended])),
        "imagined_mean_length": float(np.mean([r.obs.step - r.info["start"] for r in ended])),
    }


class _Answered:
    """The world model's batch function behind ``submit``, one request at a time."""

    def __init__(self, model, seed: int):
        self.model, self.generator = model, torch.Generator().manual_seed(seed)

    def submit(self, request) -> Future:
        future: Future = Future()
        future.set_result(world_model_replies(self.model, [request], False, self.generator, 0)[0])
        return future


def imagined_episodes(cfg, model, heldout: list[Episode], service: _Service, seed: int) -> list:
    """The last step of each imagined episode played after each held-out real episode, as a
    worker's ``WorldModelEnv``s play them (``info["start"]``: the real step it started from)."""
    s, rng = ImaginationSettings.from_config(cfg), random.Random(seed)
    starts, world_model = RealStarts(s.cache_episodes), _Answered(model, seed)
    space = ActionSpace("discrete", model.obs.cfg.action_vocab)
    envs = [
        WorldModelEnv(
            world_model,
            starts,
            space,
            context_frames=s.context_frames,
            threshold=s.threshold,
            max_steps=s.max_steps,
            terminal_reward=s.terminal_reward,
            fail_threshold=s.fail_threshold,
        )
        for _ in range(s.episodes_per_real)
    ]
    ended = []
    for episode in heldout:
        starts.add(episode)
        live = [(env, env.reset(seed=rng.randrange(2**31))) for env in envs]
        begun = {id(env): obs.step for env, obs in live}
        while live:
            replies = service.act_many([obs for _, obs in live], 0, 0)
            stepped = [
                (env, env.step(space.to_env(r.actions)))
                for (env, _), r in zip(live, replies, strict=True)
            ]
            live = []
            for env, result in stepped:
                if result.terminated or result.truncated:
                    ended.append(replace(result, info=result.info | {"start": begun[id(env)]}))
                else:
                    live.append((env, result.obs))
    return ended


def strip(trainer: WorldModelTrainer, starts: list[Episode], policy, seed: int) -> np.ndarray:
    """Imagined frames [STRIP_STARTS, STRIP_STEPS + 1, H, W, 3] of the first view, from each
    episode's first frame (ended episodes keep their last frame)."""
    model = trainer.model.eval()
    k = model.obs.cfg.context_frames
    contexts = [start_context(e.frames, e.actions, 0, k) for e in starts]
    played = imagine(
        model.obs,
        model.reward,
        policy,
        torch.from_numpy(np.stack([c[0] for c in contexts])),
        torch.from_numpy(np.stack([c[1] for c in contexts])),
        [e.instruction for e in starts],
        threshold=trainer.wm.threshold,
        max_steps=STRIP_STEPS,
        terminal_reward=trainer.wm.terminal_reward,
        fail_threshold=trainer.wm.failure_threshold,
        generator=torch.Generator().manual_seed(seed),
    )
    trainer.model.train()
    return played.frames[:, :, 0].numpy()


def real_strip(starts: list[Episode]) -> np.ndarray:
    """The real episodes' first STRIP_STEPS + 1 frames of the first view (the last repeated)."""
    steps = STRIP_STEPS + 1
    return np.stack([e.frames[np.minimum(np.arange(steps), e.steps), 0] for e in starts])


def main(argv: list[str] | None = None) -> int:
    """Play, fine-tune, measure; write the JSON, the plot and the frame strip."""
    args = parse_args(argv)
    work = args.work.resolve()
    model_path = work / "offline" / "model"
    cfg = load_config(
        ARM_CONFIG,
        [f"world_model.path={model_path}", "log.progress=false", *args.overrides],
    )
    policy = CheckpointPolicy(work / "start" / "run" / "checkpoint", args.seed)
    level = cfg.env.tasks[0]
    env = ENVS[cfg.env.name](cfg.env, args.seed)
    start = time.time()
    played = [
        play_episode(env, policy, task=level, seed=10**6 + args.seed * 10**4 + i, max_steps=None)
        for i in range(args.episodes)
    ]
    env.close()
    train, heldout = played[: args.train], played[args.train :]
    obs_cfg, reward_cfg = world_model_configs(
        cfg.world_model,
        image_size=cfg.env.image_size,
        instruction_tokens=cfg.vla.instruction_tokens,
        views=played[0].frames.shape[1],
        dims=env.action_space.dims,
        vocab=env.action_space.vocab,
    )
    trainer = WorldModelTrainer(cfg, obs_cfg, reward_cfg)
    trainer.add_episodes(train)
    starts = heldout[:STRIP_STARTS]
    before = strip(trainer, starts, policy, args.seed)
    rows = [{"round": 0, **measure(cfg, trainer, heldout, policy, args.seed)}]
    print(rows[-1], file=sys.stderr)
    every = cfg.world_model.train_obs_every or cfg.world_model.train_reward_every
    for r in range(1, args.rounds + 1):
        trainer.train(r * every)
        if r % args.every == 0 or r == args.rounds:
            rows.append({"round": r, **measure(cfg, trainer, heldout, policy, args.seed)})
            print(rows[-1], file=sys.stderr)
    after = strip(trainer, starts, policy, args.seed)
    name = NAME + (f"_{args.tag}" if args.tag else "")
    frames_path = args.out / f"{name}_frames.png"
    args.out.mkdir(parents=True, exist_ok=True)
    _save_strip(frames_path, real_strip(starts), before, after)
    shrink_png(frames_path)
    result = {
        "benchmark": NAME,
        **provenance(),
        "settings": {
            "work": relative(str(args.work)),
            **{k: v for k, v in vars(args).items() if k not in ("work", "out")},
        },
        "view": cfg.env.view,
        "image_size": cfg.env.image_size,
        "level": level,
        "train_steps_per_round": cfg.world_model.train_steps,
        "real": {
            "train_episodes": len(train),
            "train_steps": sum(e.steps for e in train),
            "heldout_episodes": len(heldout),
            "heldout_success": float(np.mean([e.success for e in heldout])),
            "heldout_failed_early": float(
                np.mean([e.terminated and not e.success for e in heldout])
            ),
            "heldout_mean_length": float(np.mean([e.steps for e in heldout])),
        },
        "rows": rows,
        "frames": relative(str(frames_path)),
        "wall_clock_s": time.time() - start,
    }
    save_result(args.out, name, result, plot, markdown_table(result))
    return 0


def _save_strip(path: Path, real: np.ndarray, before: np.ndarray, after: np.ndarray) -> None:
    """Rows: for each start, the real episode, imagined before and after fine-tuning."""
    fig, axes = plt.subplots(3 * len(real), 1, figsize=(12, 1.0 * 3 * len(real)))
    for i in range(len(real)):
        for j, (label, frames) in enumerate(
            (("real", real), ("imagined, pretrained", before), ("imagined, fine-tuned", after))
        ):
            ax = axes[3 * i + j]
            ax.imshow(np.concatenate(list(frames[i]), axis=1), interpolation="nearest")
            ax.set_yticks([])
            ax.set_xticks([])
            ax.set_ylabel(label, rotation=0, ha="right", va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot(result: dict, path: Path) -> Path:
    """Imagined against real outcomes, and the models' held-out quality, against rounds."""
    rows, real = result["rows"], result["real"]
    rounds = [r["round"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(rounds, [r["imagined_success"] for r in rows], "o-", label="imagined success")
    left.plot(rounds, [r["imagined_failed_early"] for r in rows], "s-", label="imagined failed")
    left.axhline(real["heldout_success"], ls="--", c="C0", label="real success")
    left.axhline(real["heldout_failed_early"], ls="--", c="C1", label="real failed")
    left.set_xlabel("world-model trainer rounds")
    left.set_ylabel("rate")
    left.legend(fontsize=8)
    right.plot(rounds, [r["success_auc"] for r in rows], "o-", label="success AUC")
    right.plot(rounds, [r["failure_auc"] for r in rows], "s-", label="failure AUC")
    right.set_xlabel("world-model trainer rounds")
    right.set_ylabel("AUC (held-out real frames)")
    twin = right.twinx()
    twin.plot(rounds, [r["psnr"] for r in rows], "^-", c="C2", label="per-step PSNR")
    twin.set_ylabel("dB")
    right.legend(loc="lower left", fontsize=8)
    twin.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{result['level']}, view={result['view']}, {result['image_size']} px")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def markdown_table(result: dict) -> str:
    """One row per measurement."""
    real = result["real"]
    lines = [
        f"view={result['view']}, {result['image_size']} px; real held-out: success "
        f"{real['heldout_success']:.2f}, failed early {real['heldout_failed_early']:.2f}, "
        f"mean length {real['heldout_mean_length']:.1f}",
        "",
        "| rounds | per-step PSNR (copy) | success AUC | failure AUC | imagined success | "
        "imagined failed early | imagined mean length |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        fail = "-" if r["failure_auc"] is None else f"{r['failure_auc']:.2f}"
        lines.append(
            f"| {r['round']} | {r['psnr']:.1f} ({r['copy_psnr']:.1f}) | {r['success_auc']:.2f} "
            f"| {fail} | {r['imagined_success']:.2f} | {r['imagined_failed_early']:.2f} "
            f"| {r['imagined_mean_length']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
