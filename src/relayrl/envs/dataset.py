"""A task whose prompts and reference answers come from a dataset file."""

from __future__ import annotations

import random

from relayrl.data.datasets import DATASETS, Example, load_examples
from relayrl.envs.arithmetic import HELDOUT_SEED, Problem


class DatasetTask:
    """Prompts from a dataset, with a held-out split fixed independently of the run seed."""

    def __init__(self, examples: list[Example], heldout_size: int):
        if heldout_size >= len(examples):
            raise ValueError(
                f"task.heldout_size={heldout_size} leaves no training prompts "
                f"in a dataset of {len(examples)}"
            )
        order = list(range(len(examples)))
        random.Random(HELDOUT_SEED).shuffle(order)
        problems = [Problem(e.prompt, e.answer) for e in examples]
        self._heldout = [problems[i] for i in order[:heldout_size]]
        self._train = [problems[i] for i in order[heldout_size:]]

    def heldout(self) -> list[Problem]:
        """The fixed held-out split."""
        return self._heldout

    def sample(self, n: int, rng: random.Random) -> list[Problem]:
        """``n`` training problems drawn with replacement, never from the held-out split."""
        return [rng.choice(self._train) for _ in range(n)]


def load_dataset_examples(
    data: str,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    template: str = "{prompt}",
) -> list[Example]:
    """``math500`` or ``gsm8k`` with their own templates, or a user file with the given fields."""
    if data in DATASETS:
        return DATASETS[data]()
    return load_examples(
        data, prompt_field=prompt_field, answer_field=answer_field, template=template
    )


def load_dataset_task(
    data: str,
    heldout_size: int,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    template: str = "{prompt}",
) -> DatasetTask:
    """The task over ``load_dataset_examples``, with ``heldout_size`` problems held out."""
    examples = load_dataset_examples(data, prompt_field, answer_field, template)
    return DatasetTask(examples, heldout_size)
