"""A learned reward driving RL: the arithmetic job trained on a reward model's score alone.

1. One supervised warm start (as a run does it) gives the checkpoint both RL runs start from.
2. A reward model (``LlamaForSequenceClassification``, one label) is initialised from that
   checkpoint, as reward models are from the SFT policy, and trained on preference pairs with the
   Bradley-Terry loss ``-log sigmoid(r(right) - r(wrong))``: the right answer against a wrong one,
   half the warm-started policy's own mistakes (8 samples per training prompt, labelled by the
   rule), as preference data comes from the SFT policy, and half synthetic near misses (one digit
   changed, a random number of the same length, a digit short or long, short strings of the
   task's characters). It never trains on the held-out problems; on them it reports how often
   the right answer outscores a near miss, one of the start policy's mistakes, and, within the
   start policy's groups of 8, how often a right sample outscores a wrong one (the comparison
   group advantages make).
3. From the warm start, ``configs/arith.yaml`` trains twice in async mode: with the rule reward
   (exact answer) and with the reward model alone (``reward_model.rule_weight=0``,
   ``weight=1``): the rewarder still scores, but only for the metrics; the trained reward is the
   classifier's logit. Both runs keep a KL term to the start policy (``--kl-coef``, 0.02 in the
   loss), as RLHF does to stay where the reward model is right.

Held-out accuracy is always the rule's (greedy, exact answer), so the two runs are measured alike.
The task is ``--digits`` (default 2) digit addition: a reward model of the policy's size,
trained for minutes on two cores, ranks right 2-digit sums above the policy's mistakes but not
3-digit ones, and RL on a reward model that cannot rank is reward hacking (docs/benchmarks.md).
The full command (about 20 minutes on the 2-core reference machine)::

    python experiments/reward_model.py

A smoke run (a minute or two)::

    python experiments/reward_model.py --steps 10 --eval-every 5 --rm-steps 50

Other options: ``--rm-steps``, ``--rm-lr``, ``--rm-policy-prompts``, ``--kl-coef``, ``--out``,
and ``a.b=value`` overrides of the shared config. It writes
``experiments/results/reward_model.json`` and ``.png`` (held-out accuracy against RL step for both
runs, and the classifier's training loss) with the command line and the machine, and prints a
Markdown table. Checkpoints and run directories are temporary.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import ray
import torch
from transformers import AutoConfig, LlamaForSequenceClassification

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import (  # noqa: E402
    from_start,
    provenance,
    relative,
    save_result,
    train_from,
    warm_start,
)

from relayrl.config import Config, load_config
from relayrl.envs.arithmetic import AdditionTask
from relayrl.executors.generator import Generator
from relayrl.executors.rewarder import Rewarder
from relayrl.models.lm import load_tokenizer

matplotlib.use("Agg")  # benchmark machines have no display

REPO = Path(__file__).resolve().parents[1]
NAME = "reward_model"


def main(argv: list[str] | None = None) -> int:
    """Train the classifier, warm-start once, run RL with each reward; write JSON + plot."""
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    began = time.time()
    with tempfile.TemporaryDirectory(prefix="relayrl-rm-") as tmp:
        tmp_dir = Path(tmp)
        print(f"[{NAME}] warm start", file=sys.stderr)
        warm = warm_start(cfg, tmp_dir / "start")
        print(f"[{NAME}] training the reward model", file=sys.stderr)
        classifier = train_classifier(cfg, args, tmp_dir / "start", tmp_dir / "rm")
        print(f"[{NAME}] reward model: {json.dumps(classifier['heldout'])}", file=sys.stderr)
        runs = {}
        try:
            for reward in ("rule", "reward_model"):
                print(f"[{NAME}] RL with the {reward} reward", file=sys.stderr)
                run_cfg = run_config(args, reward, tmp_dir)
                runs[reward] = train_from(run_cfg, tmp_dir / reward)
        finally:
            ray.shutdown()
    result = {
        "benchmark": NAME,
        **provenance(),
        "settings": {
            "config": relative(str(args.config)),
            "steps": args.steps,
            "eval_every": args.eval_every,
            "rm_steps": args.rm_steps,
            "digits": args.digits,
            "rm_lr": args.rm_lr,
            "rm_policy_prompts": args.rm_policy_prompts,
            "kl_coef": args.kl_coef,
            "overrides": [relative(item) for item in args.overrides],
        },
        "reward_model": classifier,
        "warm_start": warm,
        "runs": runs,
        "wall_clock_s": time.time() - began,
    }
    save_result(args.out, NAME, result, plot, markdown(result))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``overrides`` are ``a.b=value`` items applied to every run."""
    parser = argparse.ArgumentParser(
        description="Train a reward model, then the arithmetic job on its score alone and on the "
        "rule reward, from one warm start; report held-out accuracy."
    )
    parser.add_argument(
        "--config", type=Path, default=REPO / "configs" / "arith.yaml", help="configs/arith.yaml"
    )
    parser.add_argument("--steps", type=int, default=600, help="RL steps per run (600)")
    parser.add_argument("--eval-every", type=int, default=50, help="held-out period (50)")
    parser.add_argument(
        "--digits",
        type=int,
        default=2,
        help="task.digits of every run (2: a classifier of the policy's size verifies 2-digit "
        "sums on this machine, not 3-digit ones; see docs/benchmarks.md)",
    )
    parser.add_argument("--rm-steps", type=int, default=3000, help="classifier steps (3000)")
    parser.add_argument("--rm-lr", type=float, default=3e-4, help="classifier peak lr (3e-4)")
    parser.add_argument(
        "--rm-policy-prompts",
        type=int,
        default=1500,
        help="training problems the warm-started policy answers 8 times each, labelled by the "
        "rule: its mistakes are half of the classifier's wrong answers (1500)",
    )
    parser.add_argument(
        "--kl-coef",
        type=float,
        default=0.02,
        help="trainer.kl_coef of both RL runs: the KL to the start policy, as RLHF keeps a "
        "policy near where its reward model is right (0.02)",
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "experiments" / "results", help="experiments/results"
    )
    parser.add_argument("overrides", nargs="*", help="a.b=value overrides for every run")
    args = parser.parse_args(argv)
    if min(args.steps, args.eval_every, args.rm_steps, args.rm_policy_prompts, args.digits) < 1:
        parser.error(
            "--steps, --eval-every, --rm-steps, --rm-policy-prompts and --digits must be >= 1"
        )
    args.overrides = [f"task.digits={args.digits}", *args.overrides]
    return args


def _negative(answer: str, rng: random.Random) -> str:
    """A wrong answer: one digit changed (half the time: the near misses a policy makes), a
    random number of the same length, the answer a digit short or long, or a short string of any
    of the task's characters."""
    while True:
        kind = rng.random()
        if kind < 0.5:
            at = rng.randrange(len(answer))
            wrong = answer[:at] + rng.choice("0123456789") + answer[at + 1 :]
        elif kind < 0.65:
            wrong = "".join(rng.choice("0123456789") for _ in answer)
        elif kind < 0.75:
            at = rng.randrange(len(answer))
            wrong = answer[:at] + answer[at + 1 :]
        elif kind < 0.85:
            at = rng.randrange(len(answer) + 1)
            wrong = answer[:at] + rng.choice("0123456789") + answer[at:]
        else:
            wrong = "".join(rng.choice("0123456789+=") for _ in range(rng.randrange(0, 7)))
        if wrong != answer:
            return wrong


def _wrong_samples(pairs: tuple[list[str], list[str], list[float]]) -> dict[str, list[str]]:
    """The distinct wrong completions among labelled policy samples, by prompt."""
    wrong: dict[str, list[str]] = {}
    for prompt, completion, label in zip(*pairs, strict=True):
        if not label and completion not in wrong.setdefault(prompt, []):
            wrong[prompt].append(completion)
    return {prompt: completions for prompt, completions in wrong.items() if completions}


def _preference_batch(
    task: AdditionTask, wrong: dict[str, list[str]], size: int, rng: random.Random
) -> tuple[list[str], list[str], list[str]]:
    """``size`` (prompt, right, wrong) triples: half the start policy's own mistakes, half
    synthetic near misses of fresh problems."""
    prompts, rights, wrongs = [], [], []
    with_mistakes = list(wrong)
    for i in range(size):
        if i % 2 == 0:
            prompt = rng.choice(with_mistakes)
            right, bad = _answer(task, prompt), rng.choice(wrong[prompt])
        else:
            problem = task.sample(1, rng)[0]
            prompt, right, bad = problem.prompt, problem.answer, _negative(problem.answer, rng)
        prompts.append(prompt)
        rights.append(right)
        wrongs.append(bad)
    return prompts, rights, wrongs


def _answer(task: AdditionTask, prompt: str) -> str:
    """The right answer to ``prompt`` (``"a+b="``)."""
    a, b = prompt.rstrip("=").split("+")
    return task.problem(int(a), int(b)).answer


def train_classifier(cfg: Config, args: argparse.Namespace, start_dir: Path, out: Path) -> dict:
    """Train the reward model from the warm-start checkpoint ``start_dir`` on preference pairs
    (Bradley-Terry: ``-log sigmoid(r(right) - r(wrong))``), save it to ``out``; its loss curve
    and held-out ranking accuracy."""
    start = time.perf_counter()
    tc = cfg.task
    tokenizer = load_tokenizer(cfg.model.tokenizer_source)
    task = AdditionTask(tc.digits, tc.reverse_answer, tc.heldout_size)
    rng = random.Random(cfg.run.seed + 11)
    wrong = _wrong_samples(
        _policy_pairs(cfg, start_dir, task.sample(args.rm_policy_prompts, rng), 8)
    )
    heldout_samples = _policy_pairs(cfg, start_dir, task.heldout(), 8)
    torch.manual_seed(cfg.run.seed)
    config = AutoConfig.from_pretrained(start_dir, num_labels=1)
    config.pad_token_id = tokenizer.pad_token_id  # where each row's last real token is
    model = LlamaForSequenceClassification.from_pretrained(start_dir, config=config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.rm_lr)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, args.rm_lr, total_steps=args.rm_steps, pct_start=0.05
    )
    losses = []
    for step in range(args.rm_steps):
        prompts, rights, wrongs = _preference_batch(task, wrong, 64, rng)
        scores = _scores(model, tokenizer, prompts + prompts, rights + wrongs)
        margin = scores[: len(prompts)] - scores[len(prompts) :]
        loss = -torch.nn.functional.logsigmoid(margin).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == args.rm_steps - 1:
            losses.append((step, loss.item()))
    model.eval()
    with torch.no_grad():
        ranking = _ranking(model, tokenizer, task, heldout_samples)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {
        "path": str(out),
        "parameters": sum(p.numel() for p in model.parameters()),
        "loss": losses,
        "train_prompts_with_mistakes": len(wrong),
        "heldout": ranking,
        "time_s": time.perf_counter() - start,
    }


def _scores(model, tokenizer, prompts: list[str], completions: list[str]) -> torch.Tensor:
    """The classifier's logit for each (prompt, completion)."""
    encoded = tokenizer(prompts, completions, padding=True, return_tensors="pt")
    return model(**encoded).logits[:, 0]


def _ranking(model, tokenizer, task: AdditionTask, samples) -> dict:
    """On held-out problems: how often the right answer outscores a wrong one, for near misses
    (``synthetic``) and for the start policy's own mistakes (``policy_mistakes``); and
    ``within_groups``: in groups of the start policy's 8 samples with right and wrong ones, how
    often a right sample outscores a wrong one (the comparison group advantages make)."""
    rng = random.Random(7)
    problems = task.heldout()
    near = [_negative(p.answer, rng) for p in problems]
    prompts = [p.prompt for p in problems]
    right = _scores(model, tokenizer, prompts, [p.answer for p in problems])
    synthetic = float((right > _scores(model, tokenizer, prompts, near)).float().mean())
    mistakes = _wrong_samples(samples)
    pairs = [(prompt, completion) for prompt, bad in mistakes.items() for completion in bad]
    right_of = dict(zip(prompts, right.tolist(), strict=True))
    bad_scores = _scores(model, tokenizer, [p for p, _ in pairs], [c for _, c in pairs])
    beaten = [right_of[p] > float(s) for (p, _), s in zip(pairs, bad_scores, strict=True)]
    groups: dict[str, list[tuple[str, float]]] = {}
    for prompt, completion, label in zip(*samples, strict=True):
        groups.setdefault(prompt, []).append((completion, label))
    wins = total = 0
    for prompt, members in groups.items():
        goods = [c for c, label in members if label]
        bads = [c for c, label in members if not label]
        if goods and bads:
            scored = _scores(model, tokenizer, [prompt] * len(members), goods + bads)
            good, bad = scored[: len(goods)], scored[len(goods) :]
            wins += int((good[:, None] > bad[None, :]).sum())
            total += len(goods) * len(bads)
    return {
        "problems": len(problems),
        "synthetic": synthetic,
        "policy_mistakes": sum(beaten) / len(beaten),
        "policy_mistake_pairs": len(beaten),
        "within_groups": wins / total if total else None,
        "within_group_pairs": total,
    }


def _policy_pairs(
    cfg: Config, start_dir: Path, problems: list, k: int
) -> tuple[list[str], list[str], list[float]]:
    """``k`` samples of the warm-started policy per problem, labelled by the rule (the exact
    answer, finished): the mistakes this policy makes, which RL will meet first."""
    sampler = load_config(None, [f"model.path={start_dir}", "warm_start.max_steps=0"])
    sampler = sampler.model_copy(update={"generator": cfg.generator, "task": cfg.task})
    generator, rewarder = Generator(sampler), Rewarder(sampler)
    prompts = [generator.codec.encode(p.prompt) for p in problems]
    _, batch = rewarder.score(generator.complete(prompts, [p.answer for p in problems], k=k))
    repeated = [p.prompt for p in problems for _ in range(k)]
    return repeated, list(batch.completions), [float(r > 0) for r in batch.rewards]


def run_config(args: argparse.Namespace, reward: str, tmp_dir: Path) -> Config:
    """The config of one RL run from the warm-start checkpoint."""
    by_model = [
        f"reward_model.path={tmp_dir / 'rm'}",
        "reward_model.rule_weight=0",
        "reward_model.weight=1",
    ]
    extra = [f"trainer.kl_coef={args.kl_coef}", *(by_model if reward == "reward_model" else [])]
    return from_start(args, tmp_dir, extra)


def plot(result: dict, path: Path) -> Path:
    """Held-out accuracy against RL step for both rewards; the classifier's loss."""
    fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    for reward, run in result["runs"].items():
        steps, values = zip(*run["eval_curve"], strict=True)
        acc_ax.plot(steps, values, "o-", label=f"{reward} reward")
    acc_ax.set_xlabel("RL step")
    acc_ax.set_ylabel("held-out accuracy (greedy, exact answer)")
    acc_ax.set_title("RL from one warm start")
    acc_ax.legend()
    steps, losses = zip(*result["reward_model"]["loss"], strict=True)
    loss_ax.plot(steps, losses)
    loss_ax.set_xlabel("classifier step")
    held = result["reward_model"]["heldout"]
    loss_ax.set_ylabel("Bradley-Terry loss")
    loss_ax.set_title(
        f"reward model: right above the policy's mistakes {held['policy_mistakes']:.3f}"
    )
    m = result["machine"]
    fig.suptitle(f"relayrl reward model: {m['cpu_count']} CPUs, torch {m['torch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def markdown(result: dict) -> str:
    """One row per reward: start, end, gain; the classifier; the command."""
    lines = [
        "| reward | held-out start | held-out end | gain (points) |",
        "|---|---|---|---|",
    ]
    for reward, run in result["runs"].items():
        gain = 100 * (run["final_accuracy"] - run["start_accuracy"])
        lines.append(
            f"| {reward} | {100 * run['start_accuracy']:.1f} | {100 * run['final_accuracy']:.1f} "
            f"| {gain:+.1f} |"
        )
    rm, m = result["reward_model"], result["machine"]
    lines += [
        "",
        f"Reward model: {rm['parameters']:,} parameters, {result['settings']['rm_steps']} steps; "
        f"on held-out problems the right answer outscores a near miss "
        f"{rm['heldout']['synthetic']:.3f} of the time and one of the start policy's mistakes "
        f"{rm['heldout']['policy_mistakes']:.3f} ({rm['heldout']['policy_mistake_pairs']} pairs); "
        f"within the start policy's groups a right sample outscores a wrong one "
        f"{rm['heldout']['within_groups']:.3f} ({rm['heldout']['within_group_pairs']} pairs). "
        f"task.digits={result['settings']['digits']}; both runs with trainer.kl_coef="
        f"{result['settings']['kl_coef']}.",
        f"Command: `{result['command']}`; {m['platform']}, {m['cpu_count']} CPUs, "
        f"torch {m['torch']}; {result['wall_clock_s'] / 60:.0f} min.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
