"""Native generation engine: batched, KV-cached sampling with a Hugging Face causal LM.

One call generates at most ``max_new_tokens`` for every sequence and returns, per new token, the
log-probability under the sampling distribution (the behaviour ``mu``). A sequence that did not
finish is resumed by calling again with its tokens so far: the prompt and its partial completion
are prefilled anew under whatever weights the model holds then (the KV cache of an older version
is never reused).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel


@dataclass
class Chunk:
    """New tokens of each sequence, their behaviour log-probs, and whether each sequence ended."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finished: list[bool]


@torch.no_grad()
def sample_chunk(
    model: PreTrainedModel,
    sequences: list[list[int]],
    max_new_tokens: int,
    *,
    stop_ids: Sequence[int],
    pad_id: int,
    temperature: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> Chunk:
    """Continue every sequence by up to ``max_new_tokens`` tokens, stopping each at the first of
    ``stop_ids`` (EOS), which ends its new tokens.

    Sequences are left-padded into one batch; position ids count real tokens only, so a sequence
    gets the same positions whatever it is batched with. ``mu`` is ``log_softmax(logits / T)`` at
    the chosen token, the exact distribution sampled from (no top-k/top-p); with ``greedy`` the
    argmax is taken and ``mu`` is still reported under temperature ``T``.
    """
    batch = len(sequences)
    if batch == 0:
        return Chunk([], [], [])
    width = max(len(s) for s in sequences)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        input_ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        attention[row, width - len(seq) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    from transformers import DynamicCache

    cache = DynamicCache()
    stop = torch.tensor(list(stop_ids), dtype=torch.long)
    logits = _forward(model, input_ids, attention, positions, cache)

    done = torch.zeros(batch, dtype=torch.bool)
    new_tokens = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long)
    new_logprobs = torch.zeros((batch, max_new_tokens))
    steps = 0
    for step in range(max_new_tokens):
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        if greedy:
            token = logp.argmax(-1)
        else:
            token = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        token = torch.where(done, torch.full_like(token, pad_id), token)
        new_tokens[:, step] = token
        new_logprobs[:, step] = logp.gather(-1, token[:, None]).squeeze(-1)
        done |= torch.isin(token, stop)
        steps = step + 1
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        attention = torch.cat([attention, torch.ones((batch, 1), dtype=torch.long)], dim=1)
        positions = positions[:, -1:] + 1
        logits = _forward(model, token[:, None], attention, positions, cache)

    tokens, logprobs, finished = [], [], []
    ended = torch.isin(new_tokens[:, :steps], stop)
    for row in range(batch):
        hits = ended[row].nonzero()
        length = int(hits[0]) + 1 if len(hits) else steps
        tokens.append(new_tokens[row, :length].tolist())
        logprobs.append(new_logprobs[row, :length].tolist())
        finished.append(bool(len(hits)))
    return Chunk(tokens, logprobs, finished)


def _forward(model, input_ids, attention, positions, cache: DynamicCache) -> torch.Tensor:
    """Last-position logits, by keyword: architectures order their arguments differently
    (GPT-2 puts the cache before the attention mask)."""
    out = model(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **{_cache_keyword(type(model)): cache},
    )
    return out.logits[:, -1]


def _cache_keyword(model_class: type) -> str:
    """The name of the KV-cache argument: ``cache`` in recent transformers, else the older
    ``past_key_values``."""
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
