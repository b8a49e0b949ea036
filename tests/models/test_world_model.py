"""The world model's models: both observation backends learn a toy moving-square dynamics, the
success model learns a toy success set, the imagined reward matches hand-derived sums, a third
backend works through the registry alone, and saved or synced weights reproduce outputs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relayrl.config import ConfigError, load_config
from relayrl.models.world_model import (
    OBS_BACKENDS,
    ObservationModel,
    ObsModelConfig,
    SuccessLabels,
    SuccessModel,
    SuccessModelConfig,
    Transitions,
    build_obs_model,
    imagined_reward,
    imagined_termination,
    load_pretrained,
    pretrained_mismatch,
    save_pretrained,
    saved_version,
    world_model_configs,
)
from relayrl.models.world_model.diffusion import karras_sigmas, preconditioning
from relayrl.weight_sync import TRANSPORTS

SIZE, SQUARE, K = 16, 4, 2
# Action tokens 0..3 move the square up, down, left, right by 2 pixels, stopping at the border.
MOVES = torch.tensor([[-2, 0], [2, 0], [0, -2], [0, 2]])


def square_frames(pos: Tensor) -> Tensor:
    """uint8 [B, 1, SIZE, SIZE, 3]: a white SQUARE x SQUARE square at rows/cols ``pos`` [B, 2]."""
    frames = torch.zeros(pos.shape[0], 1, SIZE, SIZE, 3, dtype=torch.uint8)
    for i, (r, c) in enumerate(pos.tolist()):
        frames[i, 0, r : r + SQUARE, c : c + SQUARE] = 255
    return frames


def moving_square(n: int, generator: torch.Generator) -> Transitions:
    """``n`` transitions of K random moves from random positions."""
    pos = torch.randint(0, SIZE - SQUARE + 1, (n, 2), generator=generator)
    actions = torch.randint(0, len(MOVES), (n, K, 1), generator=generator)
    context = []
    for k in range(K):
        context.append(square_frames(pos))
        pos = (pos + MOVES[actions[:, k, 0]]).clamp(0, SIZE - SQUARE)
    return Transitions(torch.stack(context, 1), actions, square_frames(pos))


def toy_config(backend: str, **kwargs: object) -> ObsModelConfig:
    """An observation model for 16x16 frames, small enough to train in seconds on a CPU."""
    sizes = {"channels": 16, "levels": 2, "cond_dim": 32} | kwargs
    return ObsModelConfig(
        backend=backend, image_size=SIZE, context_frames=K, action_vocab=len(MOVES), **sizes
    )


def train(model: nn.Module, batches, steps: int, lr: float = 3e-3) -> list[float]:
    """AdamW on ``model.loss`` over ``steps`` batches; the losses in order."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model.loss(next(batches))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def toy_batches(seed: int, size: int = 32):
    """Endless moving-square batches."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield moving_square(size, generator)


def pixel_mse(a: Tensor, b: Tensor) -> float:
    """Mean squared error of uint8 frames in [0, 1] units."""
    return F.mse_loss(a.float() / 255, b.float() / 255).item()


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


def test_deterministic_backend_learns_the_moving_square():
    model = build_obs_model(toy_config("deterministic"))
    train(model, toy_batches(0), steps=100)
    test = moving_square(256, torch.Generator().manual_seed(1))

    pred = model.predict(test.context, test.actions)

    copy_last = pixel_mse(test.context[:, -1], test.next_frame)
    assert pred.dtype == torch.uint8 and pred.shape == test.next_frame.shape
    # Copying the last frame misses the 2-pixel move (~0.05); measured ~5e-4 after 100 steps.
    assert pixel_mse(pred, test.next_frame) < 0.05 * copy_last


def test_diffusion_backend_trains_down_and_samples_beat_noise():
    model = build_obs_model(toy_config("diffusion", channels=8))
    losses = train(model, toy_batches(0), steps=180, lr=6e-3)
    test = moving_square(128, torch.Generator().manual_seed(1))

    sample = model.predict(test.context, test.actions, generator=torch.Generator().manual_seed(2))

    first, last = sum(losses[:20]) / 20, sum(losses[-50:]) / 50
    assert last < 0.3 * first  # measured 0.23 of the first
    noise = torch.randint(0, 256, sample.shape, dtype=torch.uint8)
    error = pixel_mse(sample, test.next_frame)
    # Uniform noise scores ~0.33 and copying the last frame ~0.05; measured ~0.011.
    assert error < 0.1 * pixel_mse(noise, test.next_frame)
    assert error < pixel_mse(test.context[:, -1], test.next_frame)


def test_diffusion_samples_follow_the_generator():
    model = build_obs_model(toy_config("diffusion"))
    for p in model.net.out.parameters():
        nn.init.normal_(p, std=0.1)  # a zero output layer would make every sample the same
    test = moving_square(4, torch.Generator().manual_seed(1))

    def sample(seed: int) -> Tensor:
        return model.predict(
            test.context, test.actions, generator=torch.Generator().manual_seed(seed)
        )

    assert torch.equal(sample(5), sample(5))
    assert not torch.equal(sample(5), sample(6))


def test_karras_schedule_and_preconditioning_by_hand():
    # rho=2: sqrt(16)=4 down to sqrt(1)=1 in 3 even steps is 4, 2.5, 1 -> squared 16, 6.25, 1.
    assert torch.allclose(karras_sigmas(3, 1.0, 16.0, 2.0), torch.tensor([16.0, 6.25, 1.0, 0.0]))
    assert torch.allclose(karras_sigmas(1, 1.0, 16.0, 2.0), torch.tensor([16.0, 0.0]))
    # At sigma = sigma_data = 0.5: half skip, c_out = 0.25 / sqrt(0.5), c_in = 1 / sqrt(0.5).
    c_in, c_skip, c_out, c_noise = preconditioning(torch.tensor([0.5]), 0.5)
    assert c_skip.item() == pytest.approx(0.5)
    assert c_out.item() == pytest.approx(0.25 / math.sqrt(0.5))
    assert c_in.item() == pytest.approx(1 / math.sqrt(0.5))
    assert c_noise.item() == pytest.approx(math.log(0.5) / 4)


def test_continuous_actions_and_float_frames():
    cfg = toy_config("deterministic", continuous_actions=True, action_dims=2)
    model = build_obs_model(cfg)
    context = torch.rand(3, K, 1, SIZE, SIZE, 3)
    actions = torch.randn(3, K, 2)

    loss = model.loss(Transitions(context, actions, context[:, -1]))
    pred = model.predict(context, actions)

    assert loss.item() == pytest.approx(0.0, abs=1e-6)  # starts as copy-last
    assert pred.dtype == torch.float32 and torch.allclose(pred, context[:, -1], atol=1e-6)
    with pytest.raises(ValueError, match="actions must be floats"):
        model.predict(context, torch.zeros(3, K, 2, dtype=torch.int64))


def test_bad_inputs_name_the_argument():
    model = build_obs_model(toy_config("deterministic"))
    test = moving_square(2, torch.Generator().manual_seed(0))

    with pytest.raises(ValueError, match=r"context must be \[B, 2, 1, 16, 16, 3\]"):
        model.predict(test.context[:, :1], test.actions)
    with pytest.raises(ValueError, match=r"actions must be \[B, K, D\]"):
        model.predict(test.context, test.actions[:, :1])
    with pytest.raises(ValueError, match=r"action tokens must be in \[0, action_vocab=4\)"):
        model.predict(test.context, test.actions + 4)
    with pytest.raises(ValueError, match="unknown observation backend 'gan'"):
        build_obs_model(toy_config("gan"))


CORNERS = {"go to the top left": (0, 0), "go to the bottom right": (SIZE - 4, SIZE - 4)}


def corner_set(n: int, generator: torch.Generator) -> tuple[list[str], Tensor, Tensor]:
    """Instructions naming a corner, frames with the square in that corner (success), in the
    other corner, or elsewhere (failures), and the labels."""
    names = list(CORNERS)
    pos = torch.randint(0, SIZE - SQUARE + 1, (n, 2), generator=generator)
    which = torch.randint(0, 2, (n,), generator=generator)
    placed = torch.randint(0, 3, (n,), generator=generator)  # 0: named, 1: other, 2: random
    for i in range(n):
        if placed[i] < 2:
            corner = names[int(which[i]) ^ int(placed[i])]
            pos[i] = torch.tensor(CORNERS[corner])
    instructions = [names[int(w)] for w in which]
    target = torch.tensor([CORNERS[s] for s in instructions])
    success = (pos == target).all(dim=1).float()
    return instructions, square_frames(pos), success


def test_success_model_learns_which_corner_the_instruction_names():
    model = SuccessModel(SuccessModelConfig(image_size=SIZE, channels=16, hidden=32))
    generator = torch.Generator().manual_seed(0)

    def batches():
        while True:
            instructions, frames, success = corner_set(64, generator)
            yield SuccessLabels(frames, model.tokenize(instructions), success)

    train(model, batches(), steps=80)
    instructions, frames, success = corner_set(512, torch.Generator().manual_seed(1))
    prob = model.success_prob(frames, model.tokenize(instructions))

    # The same frame is a success for one instruction and a failure for the other, so an
    # instruction-blind model stays near 2/3; measured 1.0 after 80 steps.
    accuracy = ((prob > 0.5).float() == success).float().mean().item()
    assert accuracy > 0.95
    assert prob.min() >= 0 and prob.max() <= 1


def test_potential_reward_sums_to_the_change_of_potential_plus_the_terminal_term():
    probs = torch.tensor([[0.1, 0.3, 0.2, 0.95], [0.4, 0.5, 0.6, 0.7], [0.2, 0.1, 0.3, 0.3]])
    fails = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.2, 0.95, 0.0]])
    total, ended = torch.zeros(3), torch.zeros(3, dtype=torch.bool)
    rewards, ends = [], []
    for t in range(3):
        succeeded, failed, truncated = imagined_termination(
            probs[:, t + 1],
            torch.full((3,), t + 1),
            threshold=0.9,
            max_steps=3,
            next_fail=fails[:, t + 1],
            fail_threshold=0.9,
        )
        reward = imagined_reward(probs[:, t], probs[:, t + 1], succeeded, terminal_reward=1.0)
        total += reward * ~ended
        ended |= succeeded | failed | truncated
        rewards.append(reward)
        ends.append((succeeded, failed, truncated))

    # Episode 0 reaches 0.95 >= 0.9 at step 3: rewards 0.2, -0.1, 0.75 + 1; it ends in success.
    assert torch.allclose(torch.stack(rewards)[:, 0], torch.tensor([0.2, -0.1, 1.75]))
    assert ends[2][0].tolist() == [True, False, False]
    # Episode 1 never crosses: cut by the cap of 3 steps, no terminal term.
    assert ends[2][2][:2].tolist() == [False, True] and not ends[1][2][:2].any()
    # Episode 2's failure head reaches 0.95 at step 2: it ends there in failure, no terminal term.
    assert [e[1][2].item() for e in ends[:2]] == [False, True]
    expected = probs[:, -1] - probs[:, 0] + torch.tensor([1.0, 0.0, 0.0])
    expected[2] = probs[2, 2] - probs[2, 0]  # 0.3 - 0.2: the change up to the failure frame
    assert torch.allclose(total, expected)  # 0.95 - 0.1 + 1, 0.7 - 0.4 and 0.3 - 0.2


def test_success_wins_a_tie_with_failure_and_with_the_step_cap():
    succeeded, failed, truncated = imagined_termination(
        torch.tensor([0.9, 0.2, 0.95, 0.1]),
        torch.tensor([5, 5, 2, 5]),
        threshold=0.9,
        max_steps=5,
        next_fail=torch.tensor([0.0, 0.0, 0.99, 0.99]),
        fail_threshold=0.9,
    )
    assert succeeded.tolist() == [True, False, True, False]
    assert failed.tolist() == [False, False, False, True]  # failure also wins a tie with the cap
    assert truncated.tolist() == [False, True, False, False]


def test_success_and_failure_heads_learn_the_named_and_the_other_corner():
    cfg = SuccessModelConfig(image_size=SIZE, channels=16, hidden=32, failure_head=True)
    model = SuccessModel(cfg)
    generator = torch.Generator().manual_seed(0)

    def outcome(instructions: list[str], frames: Tensor) -> tuple[Tensor, Tensor]:
        """Success: the square in the named corner; failure: in the other corner."""
        other = {a: b for a, b in zip(CORNERS, reversed(CORNERS), strict=True)}
        named = torch.stack([square_frames(torch.tensor([CORNERS[s]]))[0] for s in instructions])
        wrong = torch.stack(
            [square_frames(torch.tensor([CORNERS[other[s]]]))[0] for s in instructions]
        )
        same = lambda a: (frames == a).flatten(1).all(1).float()  # noqa: E731
        return same(named), same(wrong)

    def batches():
        while True:
            instructions, frames, _ = corner_set(64, generator)
            success, failure = outcome(instructions, frames)
            yield SuccessLabels(frames, model.tokenize(instructions), success, failure)

    train(model, batches(), steps=80)
    instructions, frames, _ = corner_set(512, torch.Generator().manual_seed(1))
    success, failure = outcome(instructions, frames)
    p_success, p_failure = model.probs(frames, model.tokenize(instructions))

    # Each corner is a success for one instruction and a failure for the other (a third of the
    # frames each); an instruction-blind head stays near 2/3. Measured 0.992 and 0.998 after 80
    # steps.
    assert ((p_success > 0.5).float() == success).float().mean() > 0.95
    assert ((p_failure > 0.5).float() == failure).float().mean() > 0.95
    assert torch.allclose(model.success_prob(frames, model.tokenize(instructions)), p_success)
    with pytest.raises(ValueError, match="needs SuccessLabels.failure"):
        model.loss(SuccessLabels(frames[:2], model.tokenize(instructions[:2]), success[:2]))


def test_a_reward_model_without_the_failure_head_never_fails_and_loads_as_saved(tmp_path):
    old = SuccessModel(SuccessModelConfig(image_size=SIZE, channels=8, hidden=16))
    instructions, frames, _ = corner_set(8, torch.Generator().manual_seed(0))
    _, p_failure = old.probs(frames, old.tokenize(instructions))
    assert torch.equal(p_failure, torch.zeros(8))
    saved = save_pretrained(old, tmp_path / "reward")
    assert not load_pretrained(saved).cfg.failure_head

    # A run that wants the failure head is told which setting differs; sampling-only settings
    # of the observation model may differ freely.
    wanted = SuccessModelConfig(image_size=SIZE, channels=8, hidden=16, failure_head=True)
    assert pretrained_mismatch(saved, wanted) == ["failure_head=False (this run: True)"]
    assert pretrained_mismatch(saved, old.cfg) == []
    obs = save_pretrained(build_obs_model(toy_config("diffusion")), tmp_path / "obs")
    more_steps = dataclasses.replace(toy_config("diffusion"), denoising_steps=9)
    assert pretrained_mismatch(obs, more_steps) == []
    wider = dataclasses.replace(toy_config("diffusion"), channels=24)
    assert pretrained_mismatch(obs, wider) == ["channels=16 (this run: 24)"]
    with pytest.raises(FileNotFoundError, match="config.json and model.safetensors missing"):
        pretrained_mismatch(tmp_path / "nothing", old.cfg)


class BlendContext(ObservationModel):
    """A third backend for the test: the next frame as a learned blend of the context frames."""

    def __init__(self, cfg: ObsModelConfig) -> None:
        super().__init__(cfg)
        self.logits = nn.Parameter(torch.zeros(cfg.context_frames))

    def _blend(self, context: Tensor) -> Tensor:
        return (context * self.logits.softmax(0)[None, :, None, None, None]).sum(1)

    def model_loss(self, context: Tensor, actions: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(self._blend(context), target)

    def generate(
        self, context: Tensor, actions: Tensor, generator: torch.Generator | None
    ) -> Tensor:
        return self._blend(context)


def test_a_third_backend_is_one_class_and_a_registry_entry(monkeypatch, tmp_path):
    monkeypatch.setitem(OBS_BACKENDS, "blend", BlendContext)
    overrides = ["world_model.backend=blend", "env.image_size=16", "world_model.context_frames=2"]
    cfg = load_config(None, ["workload=embodied", *overrides], world_model=True)
    obs_cfg, _ = world_model_configs(
        cfg.world_model,
        image_size=cfg.env.image_size,
        instruction_tokens=cfg.vla.instruction_tokens,
        views=1,
        dims=1,
        vocab=len(MOVES),
    )
    model = build_obs_model(obs_cfg)
    test = moving_square(64, torch.Generator().manual_seed(1))

    train(model, toy_batches(0), steps=50, lr=0.5)
    saved = save_pretrained(model, tmp_path / "blend", version=7)
    loaded = load_pretrained(saved)

    # The blend starts even and learns to favour the last frame (measured 0.65).
    assert isinstance(model, BlendContext) and model.logits.softmax(0)[-1] > 0.6
    assert saved_version(saved) == 7 and isinstance(loaded, BlendContext)
    assert torch.equal(
        loaded.predict(test.context, test.actions), model.predict(test.context, test.actions)
    )


def test_an_unknown_backend_is_refused_with_the_allowed_ones():
    with pytest.raises(
        ConfigError,
        match="world_model.backend = 'gan': unknown backend; allowed: deterministic, diffusion",
    ):
        load_config(None, ["workload=embodied", "world_model.backend=gan"])


@pytest.mark.parametrize("backend", ["deterministic", "diffusion"])
def test_save_load_round_trip_gives_identical_outputs(backend, tmp_path):
    model = build_obs_model(toy_config(backend))
    train(model, toy_batches(0, size=8), steps=3)
    test = moving_square(8, torch.Generator().manual_seed(1))

    loaded = load_pretrained(save_pretrained(model, tmp_path / backend, version=2))

    def out(m: ObservationModel) -> Tensor:
        return m.predict(test.context, test.actions, generator=torch.Generator().manual_seed(3))

    assert type(loaded) is type(model) and loaded.cfg == model.cfg
    assert torch.equal(out(loaded), out(model))


def test_success_model_round_trip_and_weight_sync(tmp_path):
    model = SuccessModel(SuccessModelConfig(image_size=SIZE, channels=8, hidden=16))
    for p in model.parameters():
        nn.init.normal_(p, std=0.1)
    instructions, frames, _ = corner_set(16, torch.Generator().manual_seed(0))
    ids = model.tokenize(instructions)
    loaded = load_pretrained(save_pretrained(model, tmp_path / "reward", version=1))

    # Published through weight sync as the policy is: the receiver's copy answers the same.
    receiver_model = SuccessModel(model.cfg)
    disk = TRANSPORTS["disk"]
    publisher = disk.Publisher(model.state_dict(), ["wm"], timeout_s=10)
    receiver = disk.Receiver(receiver_model, [publisher.address], "wm", timeout_s=10)
    receiver.receive([publisher.publish(5, model.state_dict())])
    with receiver.serving() as version:
        synced = receiver_model.success_prob(frames, ids)
    publisher.close()

    expected = model.success_prob(frames, ids)
    assert isinstance(loaded, SuccessModel)
    assert torch.equal(loaded.success_prob(frames, ids), expected)
    assert version == 5 and torch.equal(synced, expected)
