"""Tasks: where prompts and reference answers come from."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relayrl.envs.arithmetic import AdditionTask
from relayrl.envs.chain_sum import ChainSumTask
from relayrl.envs.dataset import DatasetTask, load_dataset_task

if TYPE_CHECKING:
    from relayrl.config import TaskConfig


def build_task(tc: TaskConfig) -> AdditionTask | ChainSumTask | DatasetTask:
    """The task a config names."""
    if tc.name == "chain_sum":
        return ChainSumTask(tc.digits, tc.terms_max, tc.tail, tc.reverse_answer, tc.heldout_size)
    if tc.name == "dataset":
        return load_dataset_task(
            tc.data, tc.heldout_size, tc.prompt_field, tc.answer_field, tc.template
        )
    return AdditionTask(tc.digits, tc.reverse_answer, tc.heldout_size)
