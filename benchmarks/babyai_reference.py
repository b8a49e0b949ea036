"""Single-process PPO on BabyAI with relayrl's VLA policy: the reference for the embodied pipeline.

No Ray, no inference service, no replay buffer: ``--envs`` BabyAI envs stepped in one loop, a
rollout of ``--rollout`` steps per env, GAE (timeouts treated as terminal), then ``--epochs``
passes of shuffled minibatches with the framework's ``LOSSES[--loss]`` on the same ``VLAPolicy``.
It measures how many env steps a level needs when nothing is asynchronous or stale, so a learning
curve of ``relayrl train`` can be compared against it, and it runs the curriculum the same way:
``--stages`` lists levels, the next opening when the newest has ``--promote`` success over its
last 200 episodes.

    python benchmarks/babyai_reference.py --stages BabyAI-GoToLocalS5N2-v0 --minutes 7

It writes ``benchmarks/results/babyai_reference.json`` and ``.png`` (success per stage against
env steps, with the command line and machine); the JSON's curve keeps at most 200 of the points,
and every point (one per rollout) goes to ``steps/babyai_reference.json.gz`` under ``--out``, which
the benchmarks that time the reference read.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import coarse, provenance, relative, save_result, write_steps  # noqa: E402

from relayrl.algorithms.losses import LOSSES  # noqa: E402
from relayrl.config import load_config  # noqa: E402
from relayrl.envs.babyai import BabyAIEnv  # noqa: E402
from relayrl.executors.vla_trainer import VLATrainer  # noqa: E402
from relayrl.executors.worker_side import BLIND_INSTRUCTION  # noqa: E402
from relayrl.models.vla import VLAConfig, VLAPolicy, vla_config  # noqa: E402
from relayrl.types import Segment  # noqa: E402

NAME = "babyai_reference"
WINDOW = 200  # episodes per stage that the success rate and promotion look at
CURVE_POINTS = 200  # of the curve that the JSON in git keeps


def main(argv: list[str] | None = None) -> int:
    """Train until ``--minutes`` or ``--max-steps`` env steps; write the result files."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    trainer = relayrl_trainer(args) if args.trainer == "relayrl" else None
    model = trainer.policy if trainer else VLAPolicy(reference_vla_config(args))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-5)  # --trainer reference
    # --lag K: the policy that acts holds the weights of K updates ago, as a worker behind the
    # trainer would; its log-probs are the behaviour ones the loss corrects for.
    actor = copy.deepcopy(model) if args.lag else model
    history = deque([copy.deepcopy(model.state_dict())], maxlen=args.lag + 1)
    loss_fn = LOSSES[args.loss]
    stages = args.stages
    look = {"image_size": args.image_size, "view": args.view}
    envs = [BabyAIEnv(stages, **look, seed=args.seed * 1000 + 10 * i) for i in range(args.envs)]
    stage = 0
    obs = [env.reset(task=stages[stage]) for env in envs]
    outcomes = {s: deque(maxlen=WINDOW) for s in stages}
    curve, promotions = [], []
    n, t_len, width = args.envs, args.rollout, model.cfg.instruction_tokens
    frames, start = 0, time.time()
    while time.time() - start < args.minutes * 60 and frames < args.max_steps:
        shape = (model.cfg.views, args.image_size, args.image_size, 3)
        images = torch.zeros(t_len + 1, n, *shape, dtype=torch.uint8)
        ids = torch.zeros(t_len + 1, n, width, dtype=torch.int64)
        steps = torch.zeros(t_len + 1, n, dtype=torch.int64)
        actions = torch.zeros(t_len, n, 1, dtype=torch.int64)
        behaviour = torch.zeros(t_len, n, 1)
        values = torch.zeros(t_len + 1, n)
        rewards = torch.zeros(t_len, n)
        dones = torch.zeros(t_len, n)
        texts, successes = [], torch.zeros(t_len, n, dtype=torch.bool)
        for t in range(t_len + 1):
            images[t] = torch.from_numpy(np.stack([o.image for o in obs]))
            text = [BLIND_INSTRUCTION if args.blind else o.instruction for o in obs]
            texts.append(text)
            tokens = model.tokenize(text)
            ids[t, :, : tokens.shape[1]] = tokens
            steps[t] = torch.tensor([o.step for o in obs])
            with torch.no_grad():
                action, logp, value = actor.act(images[t], text, steps[t])
            values[t] = value
            if t == t_len:
                break
            actions[t], behaviour[t] = action, logp
            for i, env in enumerate(envs):
                result = env.step(int(action[i, 0]))
                rewards[t, i] = result.reward
                if result.terminated or result.truncated:
                    dones[t, i] = 1.0
                    successes[t, i] = bool(result.success)
                    outcomes[obs[i].task].append(float(result.success))
                    obs[i] = env.reset(task=stages[stage])
                else:
                    obs[i] = result.obs
            frames += n
        if trainer is not None:
            rollout = (images, steps, actions, behaviour, values, rewards, dones, successes)
            acted = max(trainer.version - args.lag, 0)
            trainer.train_step(to_segments(rollout, texts, stages[stage], acted))
        else:
            advantages = gae_terminal(rewards, values, dones, args.gamma, args.lam)
            returns = advantages + values[:t_len]
            flat = {
                "images": images[:t_len].flatten(0, 1),
                "ids": ids[:t_len].flatten(0, 1),
                "steps": steps[:t_len].flatten(0, 1),
                "actions": actions.flatten(0, 1),
                "behaviour": behaviour.flatten(0, 1),
                "advantages": advantages.flatten(),
                "returns": returns.flatten(),
            }
            update(model, optimizer, loss_fn, flat, args)
        if args.lag:
            history.append(copy.deepcopy(model.state_dict()))
            actor.load_state_dict(history[0])
        current = outcomes[stages[stage]]
        rates = {s: float(np.mean(d)) if d else None for s, d in outcomes.items()}
        curve.append({"env_steps": frames, "wall_s": time.time() - start, "stage": stage, **rates})
        if stage + 1 < len(stages) and len(current) == WINDOW and np.mean(current) >= args.promote:
            stage += 1
            promotions.append({"stage": stages[stage], "env_steps": frames})
        last = outcomes[stages[-1]]
        if args.stop_at and len(last) == WINDOW and np.mean(last) >= args.stop_at:
            break
    result = {
        "benchmark": NAME,
        **provenance(),
        "args": {k: relative(str(v)) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "params": sum(p.numel() for p in model.parameters()),
        "env_steps": frames,
        "env_steps_per_s": frames / (time.time() - start),
        "promotions": promotions,
        "final": {s: (float(np.mean(d)) if d else None) for s, d in outcomes.items()},
        "curve": curve,
    }
    write_steps(args.out, args.name, result)
    summary = result | {"curve": coarse(result["curve"], CURVE_POINTS)}
    save_result(args.out, args.name, summary, plot, table(summary))
    return 0


def reference_vla_config(args: argparse.Namespace) -> VLAConfig:
    """The reference's policy sizes: ``VLAConfig`` defaults, the image, and ``--vla`` items."""
    fields = {"image_size": args.image_size, "views": 2 if args.view == "both" else 1}
    fields["patch_tokens"] = not args.summary_only
    for item in args.vla:
        key, _, value = item.partition("=")
        if key not in VLAConfig.__dataclass_fields__ or not value:
            raise SystemExit(f"--vla {item!r}: expected FIELD=VALUE with a VLAConfig field")
        fields[key] = yaml.safe_load(value)
    return VLAConfig(**fields)


def relayrl_trainer(args: argparse.Namespace) -> VLATrainer:
    """relayrl's own ``VLATrainer`` on ``configs/babyai.yaml``'s trainer settings and the same
    policy sizes, every episode end terminal as the reference treats it (``--trainer relayrl``)."""
    if not args.summary_only:
        raise SystemExit("--trainer relayrl reads configs/babyai.yaml, which needs --summary-only")
    config = Path(__file__).parents[1] / "configs" / "babyai.yaml"
    overrides = [f"run.seed={args.seed}", "trainer.timeout_terminal=true", *args.trainer_set]
    overrides += [f"env.image_size={args.image_size}", *(f"vla.{item}" for item in args.vla)]
    cfg = load_config(config, overrides)
    views = 2 if args.view == "both" else 1
    sizes = vla_config(cfg.vla, image_size=cfg.env.image_size, views=views, dims=1, vocab=3)
    return VLATrainer(cfg, sizes)


def to_segments(
    rollout: tuple[torch.Tensor, ...], texts: list[list[str]], task: str, version: int
) -> list[Segment]:
    """A [T, N] rollout as the trainer's ``Segment``s: each env's steps cut at every episode end
    and at the rollout's end (bootstrapped there from the next observation)."""
    images, steps, actions, behaviour, values, rewards, dones, successes = rollout
    t_len, n = rewards.shape
    segments = []
    for i in range(n):
        first = 0
        for t in range(t_len):
            done = bool(dones[t, i])
            if not done and t < t_len - 1:
                continue
            span = slice(first, t + 1)
            segments.append(
                Segment(
                    worker=i,
                    episode=len(segments),
                    task=task,
                    instruction=texts[first][i],
                    images=images[first : t + 2, i].numpy(),
                    steps=steps[first : t + 2, i].numpy(),
                    actions=actions[span, i].numpy(),
                    logprobs=behaviour[span, i].numpy(),
                    values=values[span, i].numpy(),
                    rewards=rewards[span, i].numpy(),
                    versions=np.full(t + 1 - first, version, dtype=np.int64),
                    terminated=done,
                    episode_done=done,
                    success=bool(successes[t, i]),
                )
            )
            first = t + 1
    return segments


def gae_terminal(
    rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """GAE over a [T, N] rollout whose episode ends (``dones``) are all treated as terminal."""
    advantages = torch.zeros_like(rewards)
    last = torch.zeros(rewards.shape[1])
    for t in reversed(range(rewards.shape[0])):
        alive = 1.0 - dones[t]
        delta = rewards[t] + gamma * values[t + 1] * alive - values[t]
        last = delta + gamma * lam * alive * last
        advantages[t] = last
    return advantages


def update(
    model: VLAPolicy,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., tuple[torch.Tensor, dict[str, float]]],
    flat: dict[str, torch.Tensor],
    args: argparse.Namespace,
) -> None:
    """``--epochs`` passes of shuffled minibatches, advantages normalised per minibatch."""
    count = flat["advantages"].shape[0]
    for _ in range(args.epochs):
        order = torch.randperm(count)
        for first in range(0, count, args.minibatch):
            idx = order[first : first + args.minibatch]
            ids = flat["ids"][idx]
            ids = ids[:, : max(int((ids != 0).sum(1).max()), 1)]
            logp, entropy, values = model.evaluate_actions(
                flat["images"][idx], ids, flat["steps"][idx], flat["actions"][idx]
            )
            adv = flat["advantages"][idx]
            adv = ((adv - adv.mean()) / (adv.std() + 1e-8)).unsqueeze(-1)
            policy_loss, _ = loss_fn(logp, flat["behaviour"][idx], adv, torch.ones_like(logp))
            value_loss = (values - flat["returns"][idx]).square().mean()
            loss = policy_loss + args.value_coef * value_loss - args.entropy * entropy.mean()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()


def plot(result: dict, out_png: Path) -> Path:
    """Success over the last 200 episodes of each stage against env steps."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for stage in result["args"]["stages"]:
        points = [(c["env_steps"], c[stage]) for c in result["curve"] if c[stage] is not None]
        if points:
            ax.plot(*zip(*points, strict=True), label=stage.removeprefix("BabyAI-"))
    for p in result["promotions"]:
        ax.axvline(p["env_steps"], color="0.7", linestyle=":")
    ax.set_xlabel("env steps")
    ax.set_ylabel(f"success (last {WINDOW} episodes)")
    ax.set_ylim(0, 1)
    ax.set_title(f"single-process reference: {result['command']}", fontsize=7)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png


def table(result: dict) -> str:
    """The Markdown summary: promotions and final success per stage."""
    rows = ["| stage | opened at env steps | final success |", "|---|---|---|"]
    opened = {p["stage"]: p["env_steps"] for p in result["promotions"]}
    for i, stage in enumerate(result["args"]["stages"]):
        final = result["final"][stage]
        shown = "-" if final is None else f"{final:.3f}"
        rows.append(f"| {stage} | {0 if i == 0 else opened.get(stage, '-')} | {shown} |")
    rows.append(f"\n{result['env_steps']} env steps, {result['env_steps_per_s']:.0f}/s")
    return "\n".join(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", nargs="+", default=["BabyAI-GoToLocalS5N2-v0"])
    parser.add_argument("--promote", type=float, default=0.75)
    parser.add_argument("--blind", action="store_true", help="one constant instruction")
    parser.add_argument("--envs", type=int, default=16)
    parser.add_argument("--rollout", type=int, default=64, help="steps per env per update")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--minibatch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--entropy", type=float, default=0.05)
    parser.add_argument("--value-coef", type=float, default=0.5)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--lam", type=float, default=0.95)
    parser.add_argument("--loss", default="ppo_clip", choices=sorted(LOSSES))
    parser.add_argument("--minutes", type=float, default=7.0)
    parser.add_argument("--max-steps", type=int, default=10**9, help="env steps")
    parser.add_argument(
        "--stop-at",
        type=float,
        default=None,
        help="stop once the last stage's success over its last 200 episodes reaches this",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--view", default="egocentric", choices=["egocentric", "full", "both"])
    parser.add_argument("--image-size", type=int, default=56, help="pixels per side of a view")
    parser.add_argument(
        "--vla",
        nargs="*",
        default=[],
        metavar="FIELD=VALUE",
        help="VLAConfig fields of the reference's policy, e.g. patch_size=4 conv_layers=4",
    )
    parser.add_argument("--summary-only", action="store_true", help="VLAConfig.patch_tokens=False")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trainer",
        choices=["reference", "relayrl"],
        default="reference",
        help="reference: this file's update; relayrl: the pipeline's VLATrainer.train_step on "
        "the same rollouts (configs/babyai.yaml's trainer settings)",
    )
    parser.add_argument(
        "--lag",
        type=int,
        default=0,
        help="the acting policy is this many updates behind the trained one",
    )
    parser.add_argument(
        "--trainer-set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="with --trainer relayrl: config overrides for its trainer",
    )
    parser.add_argument("--name", default=NAME, help="result file name")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
