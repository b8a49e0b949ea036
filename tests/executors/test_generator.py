"""Generator: partial rollouts resume exactly and record the version of every token."""

from __future__ import annotations

import numpy as np
import torch
from conftest import tiny_config

from relayrl.executors.generator import Generator
from relayrl.weight_sync import TRANSPORTS
from relayrl.weight_sync.int8 import Int8Linear


def _completions_by_prompt(batches) -> dict[tuple, list[int]]:
    out = {}
    for batch in batches:
        for row in range(len(batch)):
            p, c = batch.prompt_len[row], batch.completion_len[row]
            out[tuple(batch.tokens[row, :p])] = batch.tokens[row, p : p + c].tolist()
    return out


def test_resumed_completion_equals_one_go_under_greedy_decoding():
    common = ["experiment.generator_greedy=true", "generator.max_new_tokens=9"]
    common += ["generator.group_size=2", "generator.prompts_per_step=6"]
    one_go = Generator(tiny_config(*common, "generator.max_new_tokens_per_step=9"))
    chunked = Generator(tiny_config(*common, "generator.max_new_tokens_per_step=3"))
    _, whole = one_go.generate()
    batches = [chunked.generate()[1] for _ in range(3)]
    reference = _completions_by_prompt([whole])
    resumed = _completions_by_prompt(batches)
    assert len(reference) == 6
    assert sum(len(v) >= 7 for v in reference.values()) >= 1  # some needed all three chunks
    for prompt, tokens in reference.items():
        assert resumed[prompt] == tokens


def test_every_token_carries_the_version_that_sampled_it():
    cfg = tiny_config(
        "generator.max_new_tokens=6",
        "generator.max_new_tokens_per_step=2",
        "generator.group_size=2",
    )
    gen = Generator(cfg)
    publisher = TRANSPORTS["shm"].Publisher(gen.model.state_dict(), ["generator"])
    gen.open_sync([publisher.address])
    for version in range(1, 4):
        _, batch = gen.generate()  # the third call returns the groups started by the first
        gen.update_weights(publisher.publish(version, gen.model.state_dict()))
    publisher.close()
    assert len(gen.sync_stats()["receive_s"]) == 3
    long_rows = [r for r in range(len(batch)) if batch.completion_len[r] == 6]
    assert long_rows, "expected at least one completion resumed over three calls"
    row = long_rows[0]
    p = batch.prompt_len[row]
    assert batch.versions[row, p : p + 6].tolist() == [0, 0, 1, 1, 2, 2]
    assert batch.versions[row, :p].tolist() == [-1] * p
    assert np.all(batch.logprobs[row, p : p + 6] <= 0)


def test_state_dict_round_trip_resumes_the_same_stream():
    cfg = tiny_config("generator.max_new_tokens=6", "generator.max_new_tokens_per_step=2")
    a = Generator(cfg)
    a.generate()
    state = a.state_dict()
    b = Generator(cfg)
    b.load_state_dict(state)
    _, next_a = a.generate()
    _, next_b = b.generate()
    assert np.array_equal(next_a.tokens, next_b.tokens)
    assert np.array_equal(next_a.versions, next_b.versions)


def test_an_int8_generator_serves_a_quantised_copy_of_the_trainers_weights():
    cfg = tiny_config("sync.precision=int8", "experiment.generator_greedy=true")
    trainer_side = Generator(tiny_config()).model.state_dict()
    publisher = TRANSPORTS["shm"].Publisher(trainer_side, ["generator"])
    gen = Generator(cfg)
    gen.open_sync([publisher.address])
    assert not gen.receiver.zero_copy
    ticket = publisher.publish(3, trainer_side)
    gen.update_weights(ticket)
    stored = gen.model.model.layers[0].mlp.up_proj.parametrizations.weight.original
    assert stored.dtype == torch.int8 and gen.version == 3
    meta, batch = gen.generate()
    assert meta.samples == len(batch) > 0 and np.all(batch.versions[batch.completion_mask] == 3)
    publisher.close()


def _completion_log_probs(model: torch.nn.Module, batch) -> torch.Tensor:
    """Teacher-forced log-probs of every token given the ones before it, as the trainer takes
    them: [B, T-1]."""
    tokens = torch.from_numpy(batch.tokens)
    lengths = torch.from_numpy(batch.prompt_len + batch.completion_len)
    attention = (torch.arange(tokens.shape[1])[None, :] < lengths[:, None]).long()
    with torch.no_grad():
        logits = model(input_ids=tokens, attention_mask=attention).logits[:, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def test_an_int8_generator_records_log_probs_close_to_the_fp32_models():
    """mu is the int8 model's log-prob, near the full-precision policy's but not equal to it:
    the gap that AIPO's pi/mu corrects. (It is not the int8 model's teacher-forced log-prob to
    rounding: the int8 matmul quantises activations over the whole batch.)"""
    common = ["generator.max_new_tokens=6", "generator.max_new_tokens_per_step=6"]
    trainer_model = Generator(tiny_config(*common)).model
    gen = Generator(tiny_config(*common, "generator.precision=int8"))
    assert isinstance(gen.model.model.layers[0].mlp.up_proj, Int8Linear)
    publisher = TRANSPORTS["shm"].Publisher(trainer_model.state_dict(), ["generator"])
    gen.open_sync([publisher.address])
    assert gen.receiver.precision == "int8"
    gen.update_weights(publisher.publish(1, trainer_model.state_dict()))
    _, batch = gen.generate()
    publisher.close()
    mask = torch.from_numpy(batch.completion_mask[:, 1:])
    mu = torch.from_numpy(batch.logprobs[:, 1:])[mask]
    assert len(mu) > 100
    fp32_gap = (mu - _completion_log_probs(trainer_model, batch)[mask]).abs()
    assert 1e-4 < fp32_gap.max() < 0.05 and fp32_gap.mean() < 0.01
