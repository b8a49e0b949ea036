"""Can the VLA policy read a view? Behaviour cloning of BabyAI's bot, per view and policy size.

PPO from scratch learns GoToLocal from the egocentric view, and the world model predicts the full
view far better (docs/benchmarks.md, "World model"); this probe asks whether the policy can read
the full view at all, apart from reinforcement learning. For each view it plays ``--episodes``
episodes of ``--level`` (default S7N5: not the target level) with the noisy scripted bot (the
noise only widens the states visited) and labels every state with the bot's own action
(``NoisyScriptedPolicy.advice``). Each variant (a view and ``VLAConfig`` fields) is trained by
cross-entropy on 85% of the states for ``--epochs`` epochs; reported per epoch are the train and
held-out action accuracy, and at the end the greedy policy's success on ``--eval-episodes``
episodes of ``--eval-level`` (S7N4). ``--save DIR`` keeps each variant's policy as
``DIR/NAME`` (``vla_config.json`` + ``model.safetensors``), which ``vla.path`` loads.

    python experiments/view_probe.py
    python experiments/view_probe.py --variant full4 view=full conv_layers=4 --save probe-policies

It writes ``experiments/results/view_probe.json`` and ``.png`` (held-out accuracy against epochs)
and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import yaml  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import provenance, save_result  # noqa: E402

from relayrl.envs.babyai import BabyAIEnv  # noqa: E402
from relayrl.models.vla import VLAConfig, VLAPolicy, save_vla_checkpoint  # noqa: E402
from relayrl.wm.policies import NoisyScriptedPolicy  # noqa: E402

NAME = "view_probe"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_VARIANTS = [
    ["egocentric", "view=egocentric"],
    ["full", "view=full"],
    ["full_conv4", "view=full", "conv_layers=4"],
]
HELD_OUT = 0.15


def main(argv: list[str] | None = None) -> int:
    """Collect the labelled states per view, clone each variant, write the result."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = [parse_variant(v) for v in (args.variant or DEFAULT_VARIANTS)]
    data = {}
    for view in dict.fromkeys(v["view"] for v in variants):
        start = time.time()
        data[view] = labelled_states(args, view)
        print(f"[{NAME}] {view}: {len(data[view][3])} states in {time.time() - start:.0f} s")
    runs = []
    for variant in variants:
        print(f"[{NAME}] {variant['name']}: cloning", flush=True)
        runs.append(clone(args, variant, data[variant["view"]]))
    result = {
        "benchmark": NAME,
        **provenance(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "states": {view: len(d[3]) for view, d in data.items()},
        "variants": runs,
    }
    save_result(args.out, NAME, result, plot, table(result))
    return 0


def parse_variant(items: list[str]) -> dict:
    """``NAME view=V FIELD=VALUE ...`` as a dict; a clear error for anything else."""
    if not items or "=" in items[0]:
        raise SystemExit(f"--variant {' '.join(items)}: expected NAME then FIELD=VALUE items")
    variant = {"name": items[0], "view": "egocentric", "vla": {}}
    for item in items[1:]:
        key, sep, value = item.partition("=")
        if not sep or not value:
            raise SystemExit(f"--variant {items[0]}: {item!r} is not FIELD=VALUE")
        if key == "view":
            variant["view"] = value
        elif key in VLAConfig.__dataclass_fields__:
            variant["vla"][key] = yaml.safe_load(value)
        else:
            raise SystemExit(f"--variant {items[0]}: {key!r} is neither view nor a VLAConfig field")
    return variant


def labelled_states(args: argparse.Namespace, view: str) -> tuple:
    """Images, instructions, steps and the bot's actions of ``--episodes`` noisy-bot episodes."""
    env = BabyAIEnv(args.level, image_size=args.image_size, view=view, seed=args.seed)
    bot = NoisyScriptedPolicy(env.action_space, args.noise, args.seed)
    images, texts, steps, labels = [], [], [], []
    try:
        for _ in range(args.episodes):
            obs = env.reset()
            bot.reset(env)
            while True:
                action = bot.act(obs)
                if bot.advice is not None:
                    images.append(obs.image)
                    texts.append(obs.instruction)
                    steps.append(obs.step)
                    labels.append(bot.advice)
                result = env.step(int(action[0]))
                if result.terminated or result.truncated:
                    break
                obs = result.obs
    finally:
        env.close()
    return torch.from_numpy(np.stack(images)), texts, torch.tensor(steps), torch.tensor(labels)


def clone(args: argparse.Namespace, variant: dict, data: tuple) -> dict:
    """One variant cloned on ``data``: accuracy per epoch and the greedy success at the end."""
    images, texts, steps, labels = data
    torch.manual_seed(args.seed)
    cfg = VLAConfig(
        image_size=args.image_size,
        views=images.shape[1],
        patch_size=args.image_size // 7,
        patch_tokens=False,
        **variant["vla"],
    )
    model = VLAPolicy(cfg)
    ids = model.tokenize(texts)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(args.seed))
    cut = int(len(labels) * (1 - HELD_OUT))
    train, held = order[:cut], order[cut:]
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    curve, start = [], time.time()
    for epoch in range(1, args.epochs + 1):
        model.train()
        train = train[torch.randperm(len(train))]
        for i in range(0, len(train), args.batch):
            b = train[i : i + args.batch]
            logits, _ = model(images[b], ids[b], steps[b])
            loss = F.cross_entropy(logits[:, 0], labels[b])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        curve.append(
            {
                "epoch": epoch,
                "train_accuracy": accuracy(model, images, ids, steps, labels, train[:2000]),
                "heldout_accuracy": accuracy(model, images, ids, steps, labels, held),
                "wall_s": time.time() - start,
            }
        )
        print(f"[{NAME}] {variant['name']} {curve[-1]}", flush=True)
    success = greedy_success(args, model, variant["view"])
    if args.save:
        save_vla_checkpoint(args.save / variant["name"], model.state_dict(), model.cfg, 0)
    return {
        **variant,
        "params": sum(p.numel() for p in model.parameters()),
        "curve": curve,
        "greedy_success": success,
    }


@torch.no_grad()
def accuracy(model, images, ids, steps, labels, index) -> float:
    """The share of ``index``'s states whose most likely action is the bot's."""
    model.eval()
    hits = 0
    for i in range(0, len(index), 512):
        b = index[i : i + 512]
        logits, _ = model(images[b], ids[b], steps[b])
        hits += int((logits[:, 0].argmax(-1) == labels[b]).sum())
    return hits / max(len(index), 1)


@torch.no_grad()
def greedy_success(args: argparse.Namespace, model: VLAPolicy, view: str) -> float:
    """The success rate of the greedy policy on ``--eval-episodes`` episodes of the eval level."""
    model.eval()
    env = BabyAIEnv(args.eval_level, image_size=args.image_size, view=view, seed=args.seed + 7)
    wins = 0
    try:
        for _ in range(args.eval_episodes):
            obs = env.reset()
            while True:
                image = torch.from_numpy(obs.image[None])
                action, _, _ = model.act(
                    image, [obs.instruction], torch.tensor([obs.step]), greedy=True
                )
                result = env.step(int(action[0, 0]))
                if result.terminated or result.truncated:
                    wins += bool(result.success)
                    break
                obs = result.obs
    finally:
        env.close()
    return wins / args.eval_episodes


def plot(result: dict, path: Path) -> Path:
    """Held-out action accuracy against epochs, one line per variant."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in result["variants"]:
        epochs = [c["epoch"] for c in run["curve"]]
        label = f"{run['name']} (greedy success {run['greedy_success']:.2f})"
        ax.plot(epochs, [c["heldout_accuracy"] for c in run["curve"]], marker="o", label=label)
    ax.set_xlabel("epoch")
    ax.set_ylabel("held-out accuracy (bot's action)")
    ax.set_title(f"behaviour cloning, {result['settings']['level']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def table(result: dict) -> str:
    """The Markdown table of the variants."""
    eval_level = result["settings"]["eval_level"]
    rows = [
        "| variant | view | VLA fields | held-out accuracy, last (best) | greedy success on "
        f"{eval_level} |",
        "|---|---|---|---|---|",
    ]
    for run in result["variants"]:
        best = max(c["heldout_accuracy"] for c in run["curve"])
        last = run["curve"][-1]["heldout_accuracy"]
        fields = " ".join(f"{k}={v}" for k, v in run["vla"].items()) or "-"
        rows.append(
            f"| {run['name']} | {run['view']} | {fields} | {last:.3f} ({best:.3f}) | "
            f"{run['greedy_success']:.2f} |"
        )
    return "\n".join(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--level", default="BabyAI-GoToLocalS7N5-v0", help="demonstrated level")
    parser.add_argument("--eval-level", default="BabyAI-GoToLocalS7N4-v0")
    parser.add_argument("--episodes", type=int, default=3000, help="noisy-bot episodes per view")
    parser.add_argument("--noise", type=float, default=0.3, help="random-action probability")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--image-size", type=int, default=28, help="pixels per side (7 cells)")
    parser.add_argument("--eval-episodes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--variant",
        nargs="+",
        action="append",
        metavar="NAME [FIELD=VALUE ...]",
        help="a variant: its name, view=egocentric|full|both and VLAConfig fields; repeatable "
        "(default: egocentric; full; full with conv_layers=4)",
    )
    parser.add_argument("--save", type=Path, default=None, help="keep each variant's policy here")
    parser.add_argument("--out", type=Path, default=REPO / "experiments" / "results")
    args = parser.parse_args(argv)
    if args.image_size % 7:
        parser.error(f"--image-size {args.image_size} must be a multiple of the 7-cell view")
    if min(args.episodes, args.epochs, args.batch, args.eval_episodes) < 1:
        parser.error("--episodes, --epochs, --batch and --eval-episodes must be >= 1")
    return args


if __name__ == "__main__":
    sys.exit(main())
