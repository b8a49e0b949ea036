"""VLAPolicy: shapes, log-prob consistency, critic isolation, tokenizer and determinism."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from relayrl.envs.embodied import ActionSpace
from relayrl.models.value_heads import AcceValueHead
from relayrl.models.vla import _WORD_IDS, PAD_ID, VLAConfig, VLAPolicy

# Small enough that every test runs in well under a second.
SMALL = dict(image_size=16, patch_size=4, channels=8, d_model=16, layers=1, heads=2)


def make(space: ActionSpace, views: int = 1, seed: int = 0, **overrides) -> VLAPolicy:
    """A small policy for ``space``."""
    torch.manual_seed(seed)
    cfg = VLAConfig(
        **{**SMALL, **overrides}, views=views, action_dims=space.dims, action_vocab=space.vocab
    )
    return VLAPolicy(cfg)


def inputs(batch: int, views: int = 1, size: int = 16, seed: int = 1):
    """Random uint8 images, instructions and steps."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (batch, views, size, size, 3), generator=g, dtype=torch.uint8)
    instructions = ["go to the red ball", "Go to the BLUE key!", "", "pick up a zorblax"][:batch]
    steps = torch.arange(batch, dtype=torch.int64) * 30
    return images, instructions, steps


DISCRETE = ActionSpace("discrete", 3)
CONTINUOUS = ActionSpace("continuous", 7, low=(-1.0,) * 7, high=(1.0,) * 7, bins=256)


@pytest.mark.parametrize(("space", "views"), [(DISCRETE, 1), (CONTINUOUS, 2)])
def test_shapes_and_dtypes(space: ActionSpace, views: int) -> None:
    model = make(space, views=views)
    images, instructions, steps = inputs(4, views)
    logits, values = model(images, model.tokenize(instructions), steps)
    assert logits.shape == (4, space.dims, space.vocab)
    assert values.shape == (4,)
    actions, logprobs, values = model.act(images, instructions, steps)
    assert actions.shape == logprobs.shape == (4, space.dims)
    assert actions.dtype == torch.int64 and logprobs.dtype == values.dtype == torch.float32
    assert int(actions.min()) >= 0 and int(actions.max()) < space.vocab
    assert bool((logprobs <= 0).all())


def test_initial_policy_is_near_uniform() -> None:
    # The action head starts with gain 0.01, so every token starts close to 1/vocab.
    model = make(CONTINUOUS)
    images, instructions, steps = inputs(4)
    _, logprobs, _ = model.act(images, instructions, steps)
    torch.testing.assert_close(
        logprobs, torch.full_like(logprobs, -torch.log(torch.tensor(256.0))), atol=0.05, rtol=0
    )


@pytest.mark.parametrize("space", [DISCRETE, CONTINUOUS])
def test_act_logprobs_match_evaluate_actions(space: ActionSpace) -> None:
    model = make(space)
    images, instructions, steps = inputs(4)
    actions, logprobs, values = model.act(images, instructions, steps)
    ids = model.tokenize(instructions)
    logp, entropy, values2 = model.evaluate_actions(images, ids, steps, actions)
    torch.testing.assert_close(logp, logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(values2, values, atol=1e-5, rtol=0)
    # Naive reference: log-softmax of the forward logits at the chosen tokens, and -sum p log p.
    with torch.no_grad():
        logits, _ = model(images, ids, steps)
    probs = torch.softmax(logits, -1)
    assert logp.requires_grad and entropy.requires_grad
    logp, entropy = logp.detach(), entropy.detach()
    for b in range(4):
        for d in range(space.dims):
            a = int(actions[b, d])
            assert abs(float(logp[b, d]) - float(torch.log(probs[b, d, a]))) < 1e-5
            naive = -sum(float(q * torch.log(q)) for q in probs[b, d])
            assert abs(float(entropy[b, d]) - naive) < 1e-4


def test_greedy_takes_the_argmax() -> None:
    model = make(DISCRETE)
    with torch.no_grad():
        model.action_head.bias.copy_(torch.tensor([0.0, 5.0, 0.0]))
    images, instructions, steps = inputs(4)
    actions, logprobs, _ = model.act(images, instructions, steps, greedy=True)
    logits, _ = model(images, model.tokenize(instructions), steps)
    assert actions.squeeze(-1).tolist() == logits.argmax(-1).squeeze(-1).tolist() == [1, 1, 1, 1]


def backbone_params(model: VLAPolicy) -> list[torch.nn.Parameter]:
    """Every parameter outside the value head."""
    return [p for n, p in model.named_parameters() if not n.startswith("value_head.")]


def test_detached_value_loss_does_not_reach_the_backbone() -> None:
    model = make(DISCRETE)
    images, instructions, steps = inputs(4)
    actions = torch.zeros(4, 1, dtype=torch.int64)
    _, _, values = model.evaluate_actions(images, model.tokenize(instructions), steps, actions)
    values.pow(2).sum().backward()
    assert all(p.grad is None or not p.grad.any() for p in backbone_params(model))
    assert model.value_head.query.grad is not None and model.value_head.query.grad.abs().sum() > 0


def test_undetached_value_loss_reaches_the_backbone() -> None:
    # The control for the test above: the same loss with detach_value=False trains the backbone.
    model = make(DISCRETE, detach_value=False)
    images, instructions, steps = inputs(4)
    _, values = model(images, model.tokenize(instructions), steps)
    values.pow(2).sum().backward()
    assert model.stem.weight.grad is not None and model.stem.weight.grad.abs().sum() > 0
    # the critic reads the policy's logits but never trains the action head through them
    assert all(p.grad is None or not p.grad.any() for p in model.action_head.parameters())


def test_policy_loss_reaches_the_encoder_and_not_the_critic() -> None:
    model = make(DISCRETE)
    images, instructions, steps = inputs(4)
    actions = torch.ones(4, 1, dtype=torch.int64)
    logp, _, _ = model.evaluate_actions(images, model.tokenize(instructions), steps, actions)
    logp.sum().backward()
    assert model.stem.weight.grad.abs().sum() > 0
    assert model.films[0].weight.grad.abs().sum() > 0
    assert model.value_head.query.grad is None


def test_value_depends_on_the_step_and_clips_it() -> None:
    model = make(DISCRETE, max_episode_steps=10)
    images, instructions, _ = inputs(1)
    ids = model.tokenize(instructions[:1])
    with torch.no_grad():
        value = {s: float(model(images, ids, torch.tensor([s]))[1]) for s in (0, 5, 10, 50)}
    assert value[0] != value[5]
    assert value[10] == value[50]


def test_tokenize_pads_truncates_and_hashes_unknown_words() -> None:
    model = make(DISCRETE, instruction_tokens=6)
    ids = model.tokenize(["Go to the RED ball.", "", "go to the zorblax", "a " * 10])
    go, to, the, red, ball = (_WORD_IDS[w] for w in ["go", "to", "the", "red", "ball"])
    assert ids.dtype == torch.int64 and ids.shape == (4, 6)
    assert ids[0].tolist() == [go, to, the, red, ball, PAD_ID]
    assert ids[1].tolist() == [PAD_ID] * 6
    unknown = int(ids[2, 3])
    first_hash = 1 + len(_WORD_IDS)
    assert first_hash <= unknown < first_hash + model.cfg.hash_buckets
    assert ids[2, :3].tolist() == [go, to, the] and ids[2, 4:].tolist() == [PAD_ID] * 2
    assert ids[3].tolist() == [_WORD_IDS["a"]] * 6
    # The hash is stable (crc32, not Python's salted hash) and the batch width is the longest row.
    assert int(model.tokenize(["zorblax"])[0, 0]) == unknown
    assert model.tokenize(["go to"]).shape == (1, 2)


def test_tokenize_rejects_a_single_string() -> None:
    with pytest.raises(TypeError, match="list of strings"):
        make(DISCRETE).tokenize("go to the red ball")


def test_instruction_changes_the_policy() -> None:
    model = make(DISCRETE)
    images, _, steps = inputs(2)
    images = images[:1].expand(2, -1, -1, -1, -1)
    logits, _ = model(images, model.tokenize(["go to the red ball", "go to the blue key"]), steps)
    assert not torch.allclose(logits[0], logits[1])


def test_bad_inputs_name_the_argument() -> None:
    model = make(DISCRETE)
    images, instructions, steps = inputs(2)
    ids = model.tokenize(instructions[:2])
    with pytest.raises(ValueError, match="images must be uint8"):
        model(images.float(), ids, steps)
    with pytest.raises(ValueError, match="images must be uint8"):
        model(images[:, :, :8], ids, steps)
    with pytest.raises(ValueError, match="steps must have shape"):
        model(images, ids, steps[:1])
    with pytest.raises(ValueError, match="actions must have shape"):
        model.evaluate_actions(images, ids, steps, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="patch_size"):
        VLAConfig(image_size=50, patch_size=8)
    with pytest.raises(ValueError, match="d_model"):
        VLAConfig(d_model=30, heads=4)
    with pytest.raises(ValueError, match="action_vocab must be a positive int"):
        VLAConfig(action_vocab=0)


def test_same_seed_same_model_and_samples() -> None:
    images, instructions, steps = inputs(4)
    runs = []
    for _ in range(2):
        model = make(CONTINUOUS, seed=3)
        torch.manual_seed(7)
        runs.append(model.act(images, instructions, steps))
    for a, b in zip(runs[0], runs[1], strict=True):
        assert torch.equal(a, b)
    other = make(CONTINUOUS, seed=4)
    assert not torch.equal(other.action_head.weight, make(CONTINUOUS, seed=3).action_head.weight)


def test_default_config_parameter_count() -> None:
    # The BabyAI default; the count changes only when a size knob or the vocabulary does.
    model = VLAPolicy(VLAConfig())
    assert sum(p.numel() for p in model.parameters()) == 211172


@pytest.mark.parametrize(("space", "views"), [(DISCRETE, 1), (CONTINUOUS, 2)])
def test_summary_only_feeds_the_backbone_one_token_per_view(space: ActionSpace, views: int) -> None:
    model = make(space, views=views, patch_tokens=False)
    images, instructions, steps = inputs(4, views)
    ids = model.tokenize(instructions)
    mission = model.word_embedding(ids).mean(1)
    assert model._encode_images(images, mission).shape == (4, views, SMALL["d_model"])
    assert not hasattr(model, "patch_proj") and not hasattr(model, "patch_position")
    # The image still reaches the actions: a different picture, a different policy.
    logits, values = model(images, ids, steps)
    other, _ = model(images.flip(2), ids, steps)
    assert logits.shape == (4, space.dims, space.vocab) and values.shape == (4,)
    assert not torch.allclose(logits, other)
    # Every parameter gets a gradient from the policy and value losses.
    logprobs, entropy, values = model.evaluate_actions(
        images, ids, steps, torch.zeros(4, space.dims, dtype=torch.int64)
    )
    (logprobs.sum() + values.sum()).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_value_head_is_chosen_by_config_and_keeps_the_critic_isolated() -> None:
    model = make(CONTINUOUS, value_head="acce")
    assert isinstance(model.value_head, AcceValueHead)
    images, instructions, steps = inputs(4)
    actions = torch.zeros(4, CONTINUOUS.dims, dtype=torch.int64)
    _, _, values = model.evaluate_actions(images, model.tokenize(instructions), steps, actions)
    assert values.shape == (4,)
    values.pow(2).sum().backward()
    assert all(p.grad is None or not p.grad.any() for p in backbone_params(model))
    assert model.value_head.scorer.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="value_head must be one of"):
        VLAConfig(value_head="mean_pool")


def test_vla_config_round_trips_through_json_and_old_files_load() -> None:
    # vla_config.json is json.dumps(asdict(cfg)); read back as VLAConfig(**json).
    cfg = VLAConfig(**SMALL, value_head="acce")
    saved = json.loads(json.dumps(asdict(cfg)))
    assert VLAConfig(**saved) == cfg
    del saved["value_head"]  # a checkpoint written before the option existed
    assert VLAConfig(**saved).value_head == "action_aware_attention"
