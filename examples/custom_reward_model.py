"""A reward model of your own, as an executor: a character-count classifier trained here.

``CountingRewardModel`` is a scoring stage (a ``relayrl.pipeline.StageExecutor``) that owns a
small torch model: a logistic regression over the counts of each character of the prompt and of
the completion. The script trains it in a few seconds to tell right sums from wrong ones (it
learns, e.g., that the answer's length and digits go with the operands'), saves it, and every
replica of the stage loads it. The batch's reward becomes the rule reward plus ``weight`` times
the model's probability that the completion is right. For a Hugging Face sequence classifier no
code is needed: set ``reward_model.path`` (see docs/api.md).

    python examples/custom_reward_model.py --steps 300 --run-dir runs/counting-rm

Any ``a.b=value`` overrides of configs/arith.yaml may follow.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from relayrl.config import load_config
from relayrl.envs.arithmetic import AdditionTask
from relayrl.models.lm import load_tokenizer
from relayrl.pipeline import Pipeline, Stage, StageExecutor

REPO = Path(__file__).resolve().parents[1]
ALPHABET = "0123456789+="


def features(prompt: str, completion: str) -> torch.Tensor:
    """Counts of each character of ``ALPHABET`` in the prompt, then in the completion."""
    counts = [prompt.count(c) for c in ALPHABET] + [completion.count(c) for c in ALPHABET]
    return torch.tensor(counts, dtype=torch.float32)


def train_model(task: AdditionTask, path: Path, steps: int = 300) -> float:
    """Fit the logistic regression on right and wrong answers; save it; its training accuracy."""
    rng = random.Random(0)
    rows, labels = [], []
    for problem in task.sample(2000, rng):
        wrong = str(rng.randrange(10 ** (len(problem.answer) + rng.choice((-1, 0, 1)))))
        for completion, label in ((problem.answer, 1.0), (wrong, 0.0)):
            rows.append(features(problem.prompt, completion))
            labels.append(label)
    x, y = torch.stack(rows), torch.tensor(labels)
    model = torch.nn.Linear(x.shape[1], 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(steps):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x)[:, 0], y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.save(model.state_dict(), path)
    return float(((model(x)[:, 0] > 0).float() == y).float().mean())


class CountingRewardModel(StageExecutor):
    """Adds ``weight`` times the classifier's probability of a right answer to each reward."""

    name = "counting_rm"

    def __init__(self, cfg, path: str, weight: float = 0.5):
        super().__init__(cfg)
        self.model = torch.nn.Linear(2 * len(ALPHABET), 1)
        self.model.load_state_dict(torch.load(path))
        self.weight = weight
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_source)

    @torch.no_grad()
    def score(self, batch):
        """The batch with the classifier's weighted probability added to each reward."""
        prompts = [
            self.tokenizer.decode(row[:p], skip_special_tokens=True)
            for row, p in zip(batch.tokens, batch.prompt_len, strict=True)
        ]
        x = torch.stack([features(p, c) for p, c in zip(prompts, batch.completions, strict=True)])
        probability = torch.sigmoid(self.model(x)[:, 0]).numpy()
        rewards = (batch.rewards + self.weight * probability).astype(np.float32)
        return self.summary(batch), replace(batch, rewards=rewards)


def main(argv: list[str] | None = None) -> int:
    """Train the classifier, then the arithmetic job with it as a reward model."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="RL steps (300)")
    parser.add_argument("--weight", type=float, default=0.5, help="weight of its score (0.5)")
    parser.add_argument("--run-dir", type=Path, default=Path("runs/custom-reward-model"))
    parser.add_argument("overrides", nargs="*", help="a.b=value overrides")
    args = parser.parse_args(argv)
    overrides = [f"steps={args.steps}", *args.overrides]
    cfg = load_config(REPO / "configs" / "arith.yaml", overrides)
    task = AdditionTask(cfg.task.digits, cfg.task.reverse_answer, cfg.task.heldout_size)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "counting_rm.pt"
        print(f"classifier training accuracy: {train_model(task, path):.3f}")
        stage = Stage(
            "counting_rm",
            CountingRewardModel,
            kwargs={"path": str(path), "weight": args.weight},
        )
        summary = Pipeline(cfg, stages=[stage]).train(args.run_dir)
    print(json.dumps({"eval": summary["eval"], "samples": summary["samples"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
