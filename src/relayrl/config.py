"""Typed run configuration: YAML file + ``a.b=c`` overrides, validated once at start-up.

OmegaConf parses the YAML and the dot-list overrides; pydantic validates the merged tree against
the models below, which are the single source of truth for every knob and its default.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from relayrl.data.datasets import check_source

# The registries these name (relayrl.algorithms.losses.LOSSES, .advantages.ADVANTAGES) import
# torch; the config does not, so that actors which never touch a tensor (rollout workers, replay
# buffers) start without it. Validators look the registries up when they run.
BUILTIN_LOSSES = (
    "aipo",
    "aipo_clamp",
    "ess_aipo",
    "geo_mask",
    "gipo",
    "m2po",
    "m2po_release",
    "mis_seq",
    "mis_seq_verl",
    "pg",
    "ppo_clip",
    "tis_seq",
)
"""The losses relayrl ships, as the trainer.loss description lists them."""
BUILTIN_ADVANTAGES = ("dr_grpo", "grpo")
"""The group advantages relayrl ships, as the trainer.advantage description lists them."""


class ConfigError(ValueError):
    """A configuration problem, described in one line that names the field."""


class _Section(BaseModel):
    # `run.name=2024` reaches a str field as an int (YAML and dot-lists parse it so): accept it.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True)


def _resources(role: str) -> Any:
    """The ``resources`` field of a role's section: Ray resources each of its actors needs."""
    return Field(
        default_factory=dict,
        description=f"Ray resources each {role} actor needs, e.g. {{node_type_a: 1}} pins it to "
        "nodes started with that resource; {}: anywhere.",
    )


class RunConfig(_Section):
    """Where a run writes and how it is seeded."""

    name: str = Field("run", description="Run name; the run directory is OUT_DIR/NAME-TIMESTAMP.")
    out_dir: str = Field("runs", description="Parent folder of run directories.")
    seed: int = Field(0, description="Seed for model init, task sampling and generation.")
    checkpoint_every: int = Field(
        50,
        ge=0,
        description="Write a run checkpoint (RUN_DIR/checkpoints/step-N) every this many RL "
        "steps, for `relayrl train --resume`; 0 writes none (Ctrl-C still writes one).",
    )
    keep_checkpoints: int = Field(
        2, ge=1, description="How many of the newest run checkpoints to keep."
    )


class ModelConfig(_Section):
    """The policy: a local Hugging Face checkpoint, or a tiny Llama built from these sizes."""

    path: str | None = Field(
        None, description="Local Hugging Face checkpoint directory; null builds a fresh model."
    )
    tokenizer: str | None = Field(
        None,
        description="Tokenizer directory, or a tokenizer shipped with relayrl: builtin:char "
        "(digits and arithmetic signs) or builtin:byte (any UTF-8 text, one token per byte); "
        "null: model.path's own tokenizer, or builtin:char when model.path is null. It needs "
        "an EOS token; a missing pad token, or pad equal to EOS, is fine.",
    )
    hidden_size: int = Field(128, ge=8, description="Width of the fresh Llama.")
    num_layers: int = Field(3, ge=1, description="Decoder layers of the fresh Llama.")
    num_heads: int = Field(4, ge=1, description="Attention heads of the fresh Llama.")
    intermediate_size: int = Field(512, ge=8, description="MLP width of the fresh Llama.")
    max_positions: int = Field(64, ge=8, description="Longest prompt + completion, in tokens.")

    @field_validator("path")
    @classmethod
    def _path_exists(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).is_dir():
            raise ValueError("directory does not exist")
        return value

    @property
    def tokenizer_source(self) -> str:
        """Where the tokenizer comes from: ``tokenizer``, else ``path``, else builtin:char."""
        return self.tokenizer or self.path or "builtin:char"

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_exists(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.startswith("builtin:") and not Path(value).is_dir():
            raise ValueError("directory does not exist (or use builtin:char, builtin:byte)")
        if value.startswith("builtin:") and value not in ("builtin:char", "builtin:byte"):
            raise ValueError("unknown builtin tokenizer; allowed: builtin:char, builtin:byte")
        return value


class TaskConfig(_Section):
    """Where prompts and reference answers come from, with a fixed held-out split."""

    name: Literal["addition", "chain_sum", "dataset"] = Field(
        "addition",
        description="addition: synthetic sums of two operands; chain_sum: sums of a "
        "heavy-tailed number of terms, answered with running sums (long-tailed completion "
        "lengths); dataset: prompts from task.data.",
    )
    digits: int = Field(
        3, ge=1, le=6, description="addition, chain_sum: operands are below 10**digits."
    )
    reverse_answer: bool = Field(
        True,
        description="addition, chain_sum: write each sum least-significant digit first (easier).",
    )
    terms_max: int = Field(
        32, ge=2, le=256, description="chain_sum: most terms in one problem (at least 2)."
    )
    tail: float = Field(
        1.3,
        gt=0,
        le=10,
        description="chain_sum: the term count k is drawn with probability proportional to "
        "k**-tail; smaller means a heavier tail of long problems.",
    )
    heldout_size: int = Field(1000, ge=1, description="Problems in the held-out evaluation split.")
    data: str | None = Field(
        None,
        description="dataset: math500 or gsm8k (test sets shipped with relayrl), "
        "hf:NAME[:CONFIG][@SPLIT] (a Hugging Face hub dataset, split train unless named; needs "
        "the hf extra), or a .jsonl, .jsonl.gz or .parquet file.",
    )
    prompt_field: str = Field("prompt", description="dataset file: field holding the prompt.")
    answer_field: str = Field("answer", description="dataset file: field holding the answer.")
    template: str = Field("{prompt}", description="dataset file: prompt template over fields.")
    chat_template: bool = Field(
        False,
        description="Wrap each prompt as the user turn of the tokenizer's chat template, with "
        "the generation prompt appended (the tokenizer must have a template).",
    )
    answer_template: str = Field(
        "{answer}",
        description="Warm-start target built from the reference, e.g. \\boxed{{{answer}}}.",
    )

    @field_validator("data")
    @classmethod
    def _known_source(cls, value: str | None) -> str | None:
        if value is not None:
            check_source(value)
        return value

    @model_validator(mode="after")
    def _dataset_needs_data(self) -> TaskConfig:
        if self.name == "dataset" and self.data is None:
            raise ValueError("task.name=dataset needs task.data (math500, gsm8k or a file path)")
        return self


class WarmStartConfig(_Section):
    """Supervised warm start on a small fixed set of worked examples before RL."""

    max_steps: int = Field(2000, ge=0, description="Most optimizer steps; 0 skips the warm start.")
    target_accuracy: float = Field(
        0.15,
        ge=0,
        le=1,
        description="Stop once greedy accuracy on a probe of training problems reaches this; "
        "RL needs some correct samples to reinforce, and the point where supervised training "
        "gets there varies with the seed. The trainer's own policy answers the probe (in "
        "trainer.precision, whatever precision the generators serve), so the warm start does "
        "not depend on generator.precision. 0 runs max_steps.",
    )
    check_every: int = Field(20, ge=1, description="Steps between two probe evaluations.")
    probe_size: int = Field(256, ge=1, description="Training problems in the probe.")
    examples: int = Field(1000, ge=1, description="Size of the fixed worked-example set.")
    batch_size: int = Field(64, ge=1, description="Examples per step.")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate.")


class GeneratorConfig(_Section):
    """Sampling of completion groups, with partial rollouts."""

    prompts_per_step: int = Field(32, ge=1, description="New prompts started per generate call.")
    group_size: int = Field(8, ge=2, description="Completions sampled per prompt (GRPO group).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    max_new_tokens: int = Field(8, ge=1, description="Completion length cap; longer ones are cut.")
    stop: list[str] = Field(
        default_factory=list,
        description="Stop strings: a completion ends with the token that completes one (as at "
        "EOS), added to the checkpoint's generation_config.json stop_strings.",
    )
    max_new_tokens_per_step: int = Field(
        8,
        ge=1,
        description="Tokens generated per call; unfinished completions resume in a later call.",
    )
    replicas: int = Field(
        1,
        ge=1,
        description="Generator replicas, each a weight-sync receiver; in async mode each runs "
        "its own rollout loop behind the one staleness gate.",
    )
    min_lag: int = Field(
        0,
        ge=0,
        description="Force every trained sample to be exactly this many policy versions old, "
        "whatever the machine's timing (a reproducible staleness stress test): the batch "
        "generated on version v reaches the trainer at version v + min_lag. The first min_lag "
        "steps fill the pipeline and train on version-0 batches (lags 0..min_lag-1). Exact with "
        "one replica and no partial rollouts; needs max_staleness >= min_lag and, in async "
        "mode, channels.capacity >= min_lag. 0: off (lags are what timing gives).",
    )
    precision: Literal["fp32", "int8"] = Field(
        "fp32",
        description="Arithmetic of the generator's matmuls. fp32: floating point, on the weights "
        "as sync.precision holds them (bf16/fp16 copies compute in that dtype, int8/fp8 storage "
        "is dequantised first). int8: every linear layer (the output layer too) runs torch's "
        "dynamically quantised int8 matmul on int8 weights with per-row scales, and embeddings "
        "gather int8 rows; the receiver stores the weights so (sync.precision null or int8). "
        "The trainer stays in full precision; mu is the int8 model's, so AIPO's pi/mu corrects "
        "the mismatch (summary.json: staleness.ratio_mean).",
    )
    resources: dict[str, float] = _resources("generator")

    @field_validator("precision", mode="before")
    @classmethod
    def _fp8_needs_a_gpu(cls, value: Any) -> Any:
        if value == "fp8":
            raise ValueError(
                "fp8 matmuls need a CUDA GPU that has them, and relayrl generates on CPU; "
                "allowed: fp32, int8 (sync.precision=fp8 stores fp8 weights, upcast to compute)"
            )
        return value


class RewarderConfig(_Section):
    """Rule-based scoring of completions."""

    scorer: str = Field(
        "exact_answer",
        description="exact_answer: the stripped completion equals the reference; math: answer "
        "extraction and equivalence (relayrl.rewards.math); or 'module:function', a rule of your "
        "own, (completion, reference) -> float. math and rules run in a sandboxed process pool.",
    )
    workers: int = Field(2, ge=1, description="math or a rule: scoring worker processes.")
    timeout_s: float = Field(
        5.0, gt=0, description="math or a rule: per-item wall-clock limit; scores 0."
    )
    memory_mb: int = Field(
        1024, ge=64, description="math or a rule: address-space limit of each worker."
    )
    replicas: int = Field(
        1, ge=1, description="Rewarder replicas; in async mode each runs its own scoring loop."
    )
    resources: dict[str, float] = _resources("rewarder")

    @field_validator("scorer")
    @classmethod
    def _scorer_known(cls, value: str) -> str:
        if value in ("exact_answer", "math"):
            return value
        from relayrl.rewards.sandbox import check_scorer

        try:
            check_scorer(value)
        except ValueError as error:
            reason = str(error).removeprefix(f"scorer {value!r}: ")
            raise ValueError(f"{reason} (the built-in scorers: exact_answer, math)") from None
        return value


# The roles of an LLM run that the config places: a reward-model stage of reward_models (and a
# Stage of a pipeline's) takes a name of its own.
LLM_ROLES = ("trainer", "generator", "rewarder", "reward_model", "reference", "critic")


class RewardModelConfig(_Section):
    """A learned reward: a sequence-classification model scoring (prompt, completion) pairs."""

    path: str | None = Field(
        None,
        description="Local Hugging Face sequence-classification checkpoint (one label: the "
        "score) with its tokenizer; set, it places the reward_model role after the rewarder.",
    )
    weight: float = Field(
        1.0,
        description="reward = rule_weight * reward + weight * score, the reward being what the "
        "stages before gave (the rewarder's rule reward, then each earlier reward model's term).",
    )
    rule_weight: float = Field(
        1.0,
        description="Weight of the reward the stages before gave (1: reward += weight * score).",
    )
    batch_size: int = Field(64, ge=1, description="Pairs scored per forward pass.")
    max_length: int = Field(
        512, ge=8, description="Longest (prompt, completion) pair in tokens; longer are cut."
    )
    dtype: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Dtype the reward model's weights are loaded and run in."
    )
    replicas: int = Field(1, ge=1, description="Reward-model replicas.")
    resources: dict[str, float] = _resources("reward_model")

    @field_validator("path")
    @classmethod
    def _path_exists(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).is_dir():
            raise ValueError("directory does not exist")
        return value


class RewardModelStageConfig(RewardModelConfig):
    """One entry of ``reward_models``: a reward-model stage with a name of its own."""

    name: str = Field(
        description="The stage's role name (its summary section, metrics and actors): lowercase "
        "letters, digits and _, unique, not a built-in role."
    )
    path: str = Field(
        description="Local Hugging Face sequence-classification checkpoint (one label: the "
        "score) with its tokenizer; required."
    )

    @field_validator("name")
    @classmethod
    def _name_is_free(cls, value: str) -> str:
        if not re.fullmatch(r"[a-z][a-z0-9_]*", value):
            raise ValueError("use lowercase letters, digits and _, starting with a letter")
        if value in LLM_ROLES:
            raise ValueError(f"a built-in role's name ({', '.join(LLM_ROLES)}); choose another")
        return value


class CriticConfig(_Section):
    """The value model of PPO with GAE on tokens; placed when trainer.advantage = gae (LLM)."""

    lr: float = Field(1e-4, gt=0, description="AdamW learning rate of the value model.")
    epochs: int = Field(1, ge=1, description="Value-regression passes over each batch.")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount over completion tokens.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda over completion tokens.")
    resources: dict[str, float] = _resources("critic")


class ReferenceConfig(_Section):
    """The frozen reference policy of the KL term; placed only when trainer.kl_coef > 0."""

    replicas: int = Field(
        1,
        ge=1,
        description="Reference replicas; each scores the log-probs of the completions under the "
        "policy as it was when RL started (after the warm start).",
    )
    dtype: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Dtype the reference's weights are loaded and run in."
    )
    resources: dict[str, float] = _resources("reference")


class TrainerConfig(_Section):
    """Policy update: the options both workloads' trainers read."""

    ranks: int = Field(
        1,
        ge=1,
        description="Trainer ranks: one torch.distributed group (gloo on CPU) with the model "
        "sharded by FSDP2; each rank trains on its share of every batch, and each publishes its "
        "own shard of the weights to every receiver.",
    )
    resources: dict[str, float] = _resources("trainer (and replay-buffer)")

    loss: str = Field(
        "aipo",
        description="Loss name, a key of relayrl.algorithms.losses.LOSSES: "
        + ", ".join(BUILTIN_LOSSES)
        + ".",
    )
    lr: float = Field(3e-4, gt=0, description="AdamW learning rate.")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "cosine",
        description="cosine: decay from lr to lr * lr_final_ratio over the RL steps (after "
        "the warmup).",
    )
    lr_final_ratio: float = Field(0.1, ge=0, le=1, description="Final lr as a fraction of lr.")
    lr_warmup_steps: int = Field(
        0,
        ge=0,
        description="Linear warmup over the first train steps (versions): step u (from 0) runs "
        "at lr * min(1, (u + 1) / lr_warmup_steps) times the schedule; cosine then decays over "
        "the steps after the warmup. 0: none.",
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    aipo_rho: float = Field(4.0, gt=0, description="AIPO truncation rho (LlamaRL uses 2..10).")
    ppo_clip_eps: float = Field(
        0.2, gt=0, lt=1, description="PPO-clip epsilon (ppo_clip, geo_mask)."
    )
    gipo_sigma: float = Field(1.0, gt=0, description="GIPO Gaussian width for positive advantages.")
    gipo_neg_ratio: float = Field(
        0.5, gt=0, description="GIPO: negative advantages use sigma * neg_ratio."
    )
    seq_is_cap: float = Field(
        2.0,
        gt=0,
        description="tis_seq: truncation C of each sequence's importance weight prod(pi/mu) "
        "(verl's default 2; it suggests 2..10; VCPO's recipe 8), also the weight "
        "trainer.advantage=vcpo_baseline gives it.",
    )
    seq_mis_lower: float = Field(
        0.5,
        gt=0,
        le=1,
        description="mis_seq, mis_seq_verl: sequences whose weight prod(pi/mu) is below this are "
        "masked out (mis_seq_verl: and leave the token-mean's denominator, as in verl).",
    )
    seq_mis_upper: float = Field(
        2.0,
        ge=1,
        description="mis_seq, mis_seq_verl: sequences whose weight prod(pi/mu) is above this are "
        "masked out.",
    )
    geo_mask_low: float = Field(
        0.99,
        gt=0,
        le=1,
        description="geo_mask: sequences whose geometric-mean ratio exp(mean log pi/mu) is below "
        "this are masked out and leave the token-mean's denominator (SkyRL's recommended 0.99); "
        "the rest train on PPO's clip (trainer.ppo_clip_eps).",
    )
    geo_mask_high: float = Field(
        1.01,
        ge=1,
        description="geo_mask: sequences whose geometric-mean ratio is above this are masked out "
        "(SkyRL's recommended 1.01).",
    )
    m2po_tau: float = Field(
        0.04,
        gt=0,
        description="M2PO: tokens with the largest (log pi/mu)^2 are masked until the mean of "
        "the rest is <= tau (the paper's 0.04).",
    )
    proximal: Literal["behaviour", "current"] = Field(
        "behaviour",
        description="The old policy of the loss's ratio (PPO's trust region). behaviour: the "
        "policy that sampled (mu); current: the trainer's policy as the step began (llm: one "
        "no-grad pass over the step's groups before its first minibatch; embodied: from the "
        "value pass, needs value_recompute=pass), with the stale behaviour corrected apart by a "
        "stop-gradient weight min(pi_old / mu, proximal_weight_cap) on each token's advantage "
        "(the decoupled objective of Hilton et al. 2021; with loss=ppo_clip AReaL's decoupled "
        "PPO, relayrl.algorithms.decoupled). With one minibatch (llm: trainer.minibatches=1) "
        "pi_old is the policy being trained, and with loss=ppo_clip the update equals aipo's "
        "with aipo_rho=proximal_weight_cap.",
    )
    proximal_weight_cap: float = Field(
        2.0,
        gt=0,
        description="trainer.proximal=current: the most the behaviour weight pi_old / mu may be "
        "(truncated there; AReaL drops such tokens instead).",
    )
    m2po_release_budget: float = Field(
        0.04,
        gt=0,
        description="m2po_release (the M2PO authors' code, their M2_budget): PPO's clip "
        "[exp(-c), exp(c)] on pi/mu, with c set per micro-batch so that the squared log-ratios "
        "of the harmful tokens (A > 0 with pi > mu, A < 0 with pi < mu), capped at c^2, average "
        "under the budget.",
    )

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, value: str) -> str:
        from relayrl.algorithms.losses import LOSSES

        if value not in LOSSES:
            raise ValueError(f"unknown loss; allowed: {', '.join(sorted(LOSSES))}")
        return value


class LLMTrainerConfig(TrainerConfig):
    """llm: the policy update of the language model."""

    advantage: str = Field(
        "grpo",
        description="Advantage: "
        + ", ".join(BUILTIN_ADVANTAGES)
        + " (per group of completions); vcpo_baseline: each reward minus VCPO's off-policy "
        "optimal baseline, its group's mean weighted by w^2 * length with w tis_seq's sequence "
        "weight min(prod pi/mu, seq_is_cap) (needs trainer.loss=tis_seq; VCPO's recipe adds "
        "seq_is_cap=8 and ess_lr=true); or gae: PPO's, per token, from the critic's values "
        "(places the critic role).",
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="LLM policy forward (RL and warm start): fp32, or bf16 autocast (matmuls in "
        "bf16, weights, gradients and optimizer state still fp32).",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute the policy's activations in the backward pass instead of "
        "keeping them (Hugging Face gradient checkpointing): less memory, more compute.",
    )
    minibatches: int = Field(
        1,
        ge=1,
        description="Optimizer steps per version: a train step's fresh groups are cut into this "
        "many blocks of whole groups, in order, and each takes one optimizer step; the version "
        "bumps once per train step (at most generator.prompts_per_step).",
    )
    ess_lr: bool = Field(
        False,
        description="VCPO's step rule, with any loss: each step's learning rate is the "
        "schedule's times sqrt(ESS), the normalised effective sample size of the trained "
        "sequences' importance weights prod(pi/mu) over every rank (1 on-policy).",
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the KL to the reference policy (the policy when RL started); "
        "> 0 places the reference role.",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3",
        description="Per-token KL estimator (relayrl.algorithms.kl): k1 = log pi/ref, "
        "k2 = (log ref/pi)^2 / 2, k3 = ref/pi - 1 - log ref/pi.",
    )
    kl_in: Literal["loss", "reward"] = Field(
        "loss",
        description="loss: kl_coef times the token-mean estimate of KL(pi || ref) is added to "
        "the loss; reward: kl_coef times each completion's summed estimate of KL(mu || ref) is "
        "subtracted from its reward before advantages.",
    )

    @field_validator("advantage")
    @classmethod
    def _known_advantage(cls, value: str) -> str:
        from relayrl.algorithms.advantages import ADVANTAGES

        if value not in ADVANTAGES and value not in ("gae", "vcpo_baseline"):
            allowed = ", ".join([*sorted(ADVANTAGES), "gae", "vcpo_baseline"])
            raise ValueError(f"unknown advantage; allowed: {allowed}")
        return value


class EmbodiedTrainerConfig(TrainerConfig):
    """embodied: the PPO-style update of the VLA policy and its value head."""

    loss: str = Field(
        "gipo",
        description="Loss name, a key of relayrl.algorithms.losses.LOSSES: "
        + ", ".join(BUILTIN_LOSSES)
        + ".",
    )
    gamma: float = Field(0.99, ge=0, le=1, description="embodied: GAE discount.")
    lam: float = Field(0.95, ge=0, le=1, description="embodied: GAE lambda.")
    value_coef: float = Field(0.5, ge=0, description="embodied: weight of the value loss.")
    entropy_coef: float = Field(0.01, ge=0, description="embodied: weight of the entropy bonus.")
    epochs: int = Field(
        2, ge=1, description="embodied: passes over each super-batch (one version bump in all)."
    )
    minibatch_steps: int = Field(
        256,
        ge=1,
        description="embodied: env steps per optimizer step; also the micro-batch of segments "
        "whose values and GAE are recomputed together.",
    )
    value_recompute: Literal["pass", "fused", "off"] = Field(
        "pass",
        description="embodied: where GAE's values come from. pass: a no-grad pass of the current "
        "critic before training; fused: the training forward pass's own values, per micro-batch "
        "(AcceRL; needs epochs=1, minibatch_order=sequential, adv_norm=lagged_welford); off: "
        "the behaviour values the workers recorded (the bootstrap value still from the current "
        "critic).",
    )
    timeout_terminal: bool = Field(
        False,
        description="embodied: GAE treats an episode cut at the env's step limit (truncated) as "
        "ended, with no bootstrap from its last observation's value. Right when the policy sees "
        "the episode step (the VLA's step embedding) and the limit is part of the task, as in "
        "BabyAI, where running out of steps is a failure; false bootstraps, as for a limit the "
        "task itself does not have.",
    )
    minibatch_order: Literal["shuffled", "sequential"] = Field(
        "shuffled",
        description="embodied: minibatches of env steps drawn in a fresh random order each "
        "epoch, or in segment-then-step order (AcceRL's sequential slicing).",
    )
    adv_norm: Literal["batch", "lagged_welford"] = Field(
        "batch",
        description="embodied: standardise advantages with the super-batch's own mean and std "
        "(over every rank), or with the running statistics of every earlier step's advantages "
        "(relayrl.algorithms.normalization.Welford; AcceRL's lagged normalisation; the first "
        "step uses its own).",
    )

    @field_validator("value_recompute", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML reads a bare off as false


class EnvConfig(_Section):
    """embodied: the simulator each rollout worker steps (see docs/envs.md)."""

    name: Literal["babyai", "metaworld", "libero"] = Field(
        "babyai", description="Simulator: babyai, metaworld or libero (extras of the same names)."
    )
    tasks: list[str] = Field(
        ["BabyAI-GoToLocalS7N4-v0"],
        description="babyai: level ids; metaworld: task names (or MT10); libero: task names of "
        "env.suite (empty: every task of the suite).",
    )
    suite: str = Field("libero_spatial", description="libero: the suite the tasks come from.")
    image_size: int = Field(56, ge=8, description="Height and width of each camera view.")
    max_steps: int | None = Field(
        None, ge=1, description="Episode step limit; null keeps the simulator's own."
    )
    distractor_fails: bool = Field(
        True, description="babyai: facing an object the mission does not name fails the episode."
    )
    view: Literal["egocentric", "full", "both"] = Field(
        "egocentric",
        description="babyai: the image is the agent's 7 x 7-cell view (egocentric), the whole "
        "grid from above (full: objects stay in view, what a pixel world model needs; cells at "
        "the egocentric scale, grids up to 7 cells), or both as two views, egocentric first.",
    )
    blind: bool = Field(
        False,
        description="Replace every instruction with one constant string: the instruction-blind "
        "control run of the same config.",
    )
    latency: Literal["none", "constant", "uniform", "lognormal"] = Field(
        "none", description="Extra sleep after each step (LatencyEnv) to emulate slow simulators."
    )
    latency_mean_ms: float = Field(10.0, gt=0, description="Mean of the latency sleep.")
    latency_sigma: float = Field(1.0, ge=0, description="lognormal latency: sigma of the log.")
    eval_episodes: int = Field(
        64,
        ge=1,
        description="Episodes per evaluation, split over the evaluation tasks in turn, never "
        "trained on; episode i of a task is seeded from run.seed and i, the same every time.",
    )
    eval_workers: int = Field(
        4,
        ge=1,
        description="Evaluators (actors, each with its env and a copy of the policy) that share "
        "the evaluation episodes.",
    )
    eval_tasks: list[str] | None = Field(
        None,
        description="Tasks the evaluations play (eval_episodes split over them); null plays all "
        "of the env's.",
    )
    eval_greedy: bool = Field(
        False,
        description="Evaluate the most likely action instead of a sampled one; a memoryless "
        "policy can loop forever greedily where sampling gets unstuck.",
    )


class RolloutConfig(_Section):
    """embodied: rollout workers and their environments."""

    workers: int = Field(8, ge=1, description="Rollout workers (Ray actors).")
    envs_per_worker: int = Field(
        1,
        ge=1,
        description="Environments each rollout worker steps (async mode only): it asks for all "
        "their actions in one request and steps them together, one thread each.",
    )
    env_threads: bool = Field(
        True,
        description="Step each env on a thread of its own (needed by simulators whose GL "
        "context belongs to one thread: MetaWorld, LIBERO); false steps a worker's envs one "
        "after another on its own thread, cheaper for pure-Python envs such as BabyAI.",
    )
    resources: dict[str, float] = _resources("rollout-worker (and evaluator)")
    segment_len: int = Field(
        32, ge=1, description="Most steps in one trajectory segment (L); episodes are cut."
    )
    max_consecutive_errors: int = Field(
        10, ge=1, description="A worker gives up after this many env errors in a row."
    )
    dwr: bool = Field(
        True, description="Dynamic weighted resampling: start episodes on tasks still failed."
    )
    dwr_window: int = Field(50, ge=1, description="DWR: recent episodes per task that count.")
    dwr_alpha: float = Field(
        1.0,
        gt=0,
        description="DWR: smoothed: Laplace smoothing of failure rates; acce: the eps added to "
        "each task's failure count.",
    )
    dwr_formula: Literal["smoothed", "acce"] = Field(
        "smoothed",
        description="DWR task weight: smoothed (failures + alpha) / (episodes + 2 alpha); acce "
        "(AcceRL) (window - successes) + alpha, unplayed episodes counting as successes.",
    )
    curriculum: bool = Field(
        False,
        description="The env's tasks are stages in order: training starts on the first and the "
        "next opens when the newest is solved (or over its step budget); opened stages stay.",
    )
    curriculum_promote_at: float = Field(
        0.8, gt=0, le=1, description="Curriculum: success over the window that opens the next."
    )
    curriculum_window: int = Field(
        200, ge=1, description="Curriculum: recent episodes of the newest stage that count."
    )
    curriculum_review: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Curriculum: weight of the earlier open stages relative to the newest.",
    )
    curriculum_max_steps: int = Field(
        0,
        ge=0,
        description="Curriculum: trainer steps after which the next stage opens anyway (0: none).",
    )


class InferenceConfig(_Section):
    """embodied: the dynamic-batching inference service the workers ask for actions."""

    max_batch: int = Field(8, ge=1, description="Most observations one forward pass answers.")
    max_wait_ms: float = Field(
        2.0, ge=0, description="Flush a batch this long after its oldest request arrived."
    )
    replicas: int = Field(
        1,
        ge=1,
        description="Inference-service replicas, each a weight-sync receiver; rollout workers "
        "are spread over them in turn.",
    )
    min_lag: int = Field(
        0,
        ge=0,
        description="Forced policy lag K for staleness studies: the trainer publishes the weights "
        "of K versions ago (it holds K + 1 copies), so every env step is acted by a policy at "
        "least K versions older than the trainer that trains on it (exactly K in mode=sync; "
        "async adds its own 0-2). Evaluations play the served, lagged policy. Needs "
        "max_staleness >= min_lag (min_lag + 2 in async mode keeps most samples) and "
        "sync.in_place=false. 0: off (lags are what timing gives).",
    )
    resources: dict[str, float] = _resources("inference-service")


class LLMExperimentConfig(_Section):
    """llm: switches that only studies and tests flip; runs keep the defaults."""

    skip_zero_signal: bool = Field(
        True,
        description="Leave groups whose rewards are all equal (zero advantage, zero gradient) "
        "out of the forward/backward pass; the loss is rescaled so the update is unchanged. "
        "Not with m2po, ess_aipo, mis_seq_verl or geo_mask, whose batch statistics count every "
        "group's tokens. false: every batch takes an optimizer step and a version, so a forced lag "
        "(generator.min_lag) is exact whatever the rewards, and the work per step is that of "
        "a trainer that does not skip.",
    )
    generator_greedy: bool = Field(
        False,
        description="Generators take the argmax instead of sampling, so a completion is the "
        "same however it is cut into calls (a debugging and test switch: a group of equal "
        "completions carries no learning signal).",
    )


class EmbodiedExperimentConfig(_Section):
    """embodied: switches that only studies flip (docs/benchmarks.md); runs keep the defaults."""

    early_drain: bool = Field(
        True,
        description="Inference services receive new weights beside forward passes, into the "
        "receiver's second copy (held anyway, so no extra memory); requests wait only for the "
        "pointer swap. false: the whole transfer runs inside the model lock and stalls every "
        "request (the lock arm of the early-drain study).",
    )
    inference_transport: Literal["socket", "ray"] = Field(
        "socket",
        description="How rollout workers ask for actions in async mode. socket: each worker keeps "
        "a Unix-socket connection to its replica and sends raw bytes, no Ray call per env step "
        "(a worker on another node than its replica falls back to Ray calls); ray: one Ray actor "
        "call per env step (the baseline of the hot-path study).",
    )


# Options that moved, by their old key: given, they are refused naming the new one.
MOVED = {
    "inference.early_drain": "experiment.early_drain",
    "inference.transport": "experiment.inference_transport",
    "trainer.skip_zero_signal": "experiment.skip_zero_signal",
    "generator.greedy": "experiment.generator_greedy",
}


class ImaginationConfig(_Section):
    """embodied: experience imagined in the world model (AcceRL-WM); off while
    episodes_per_real is 0 (no world-model roles are placed)."""

    episodes_per_real: int = Field(
        0,
        ge=0,
        description="Imagined episodes a rollout worker starts per real episode it finishes, "
        "each from a real frame of its episode cache, in WorldModelEnv slots (this many per real "
        "env) stepped beside its real envs, with the policy service acting and the world-model "
        "service predicting; starts due while every slot is busy wait, at most one per slot; "
        "0: off.",
    )
    real_ratio: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Fraction of each super-batch's env steps taken from real segments (the "
        "rest imagined); 0: imagined only.",
    )
    cache_episodes: int = Field(
        8, ge=1, description="Real episodes each rollout worker keeps to start imagination from."
    )
    buffer_steps: int = Field(
        4096, ge=1, description="B_img: imagined env steps the imagined-segment buffer holds."
    )


class ReplayConfig(_Section):
    """embodied: the FIFO replay buffer between workers and trainer (async mode)."""

    capacity_steps: int = Field(
        4096, ge=1, description="Env steps the buffer holds; the oldest segments are evicted."
    )
    batch_steps: int = Field(
        512, ge=1, description="Env steps per super-batch, one trainer step (sync and async)."
    )
    wait_at: int | None = Field(
        None,
        ge=1,
        description="async: a rollout worker whose put leaves this many env steps in the buffer "
        "waits until the trainer asks for its next batch, so workers make only the batch asked "
        "for (plus at most this many steps) and their CPU goes to the trainer instead of to env "
        "steps that would wait a step longer (lag 2 rather than 1) or age past max_staleness; "
        "at most capacity_steps. null: workers never wait (older segments are evicted or "
        "dropped as stale).",
    )

    @model_validator(mode="after")
    def _batch_fits(self) -> ReplayConfig:
        if self.batch_steps > self.capacity_steps:
            raise ValueError(
                f"batch_steps={self.batch_steps} must be <= capacity_steps={self.capacity_steps}"
            )
        if self.wait_at is not None and self.wait_at > self.capacity_steps:
            raise ValueError(
                f"replay.wait_at={self.wait_at} must be <= capacity_steps={self.capacity_steps}"
            )
        return self


class VLAModelConfig(_Section):
    """embodied: sizes of the VLA policy (relayrl.models.vla); views, image size and the action
    vocabulary come from the environment."""

    path: str | None = Field(
        None,
        description="Folder of a saved VLA policy to start from (an embodied run's "
        "RUN_DIR/checkpoint: vla_config.json + model.safetensors); its sizes must equal this "
        "config's. null: a fresh policy. A resumed run loads its checkpoint instead.",
    )
    patch_size: int = Field(8, ge=1, description="Patch stem stride; 8 is one BabyAI cell.")
    channels: int = Field(32, ge=1, description="Channels of the convolutional image encoder.")
    conv_layers: int = Field(2, ge=0, description="FiLM-conditioned residual convolutions.")
    patch_tokens: bool = Field(
        True,
        description="Feed every image patch to the backbone; false feeds one summary token per "
        "view (about 3x less compute per sample).",
    )
    d_model: int = Field(64, ge=8, description="Width of the transformer backbone.")
    layers: int = Field(1, ge=1, description="Transformer encoder layers.")
    heads: int = Field(4, ge=1, description="Attention heads; must divide d_model.")
    ff_mult: int = Field(2, ge=1, description="Feed-forward width as a multiple of d_model.")
    instruction_tokens: int = Field(16, ge=1, description="Most instruction words kept.")
    max_episode_steps: int = Field(
        64, ge=1, description="Distinct step indices of the critic's step embedding."
    )
    detach_value: bool = Field(
        True, description="The value loss trains only the critic head, not the backbone."
    )
    value_head: Literal["action_aware_attention", "acce"] = Field(
        "action_aware_attention",
        description="Critic head: action_aware_attention (a query conditioned on the policy's "
        "action probabilities and the step attends over all tokens); acce (AcceRL D.2: "
        "softmax-pooled action-token states plus a step embedding, then a GELU MLP).",
    )

    @model_validator(mode="after")
    def _heads_divide_width(self) -> VLAModelConfig:
        if self.d_model % self.heads:
            raise ValueError(f"heads={self.heads} must divide d_model={self.d_model}")
        return self


class WorldModelConfig(_Section):
    """embodied: the world model (relayrl.models.world_model, docs/world_model.md), an
    observation model M_obs and a success model M_reward in pixel space; frame size, views and
    actions come from the environment, the instruction length from vla."""

    backend: str = Field(
        "diffusion",
        description="Observation backend, a key of relayrl.models.world_model.OBS_BACKENDS: "
        "diffusion (an EDM denoiser sampled in denoising_steps steps, as DIAMOND) or "
        "deterministic (one regression pass, cheap and blurry).",
    )
    path: str | None = Field(
        None,
        description="Folder of a pretrained world model: PATH/observation and PATH/reward, each "
        "a save_pretrained folder (model.safetensors + config.json); null: fresh models.",
    )
    context_frames: int = Field(
        4, ge=1, description="Past frames and actions the next frame is predicted from (K)."
    )
    channels: int = Field(
        32, ge=1, description="Channels of both models' convolutions, at every resolution."
    )
    levels: int = Field(
        2,
        ge=1,
        description="Down-sampling levels of the observation U-Net; env.image_size must be a "
        "multiple of 2**levels.",
    )
    cond_dim: int = Field(
        64,
        ge=2,
        multiple_of=2,
        description="Width of the action and noise-level embedding modulating every block.",
    )
    reward_hidden: int = Field(
        64, ge=1, description="Width of the reward model's instruction embedding and hidden layer."
    )
    lr: float = Field(3e-4, gt=0, description="AdamW learning rate of both models.")
    denoising_steps: int = Field(
        3, ge=1, description="diffusion: Euler steps from sigma_max to 0 per sampled frame."
    )
    sigma_data: float = Field(
        0.5, gt=0, description="diffusion: std of the frames in [-1, 1] (EDM's sigma_data)."
    )
    sigma_min: float = Field(
        2e-3, gt=0, description="diffusion: smallest noise level (training and sampling)."
    )
    sigma_max: float = Field(
        5.0, gt=0, description="diffusion: largest noise level, where sampling starts."
    )
    rho: float = Field(7.0, gt=0, description="diffusion: curvature of the sampling schedule.")
    train_sigma_loc: float = Field(
        -0.4, description="diffusion: mean of log(sigma) in training (EDM's P_mean)."
    )
    train_sigma_scale: float = Field(
        1.2, gt=0, description="diffusion: std of log(sigma) in training (EDM's P_std)."
    )
    context_noise: float = Field(
        0.3,
        ge=0,
        description="diffusion: context frames get Gaussian noise of a level drawn from "
        "[0, context_noise] in training (none when sampling); 0: off.",
    )
    threshold: float = Field(
        0.9,
        gt=0,
        le=1,
        description="An imagined episode ends in success when the reward model's success "
        "probability reaches this.",
    )
    failure_head: bool = Field(
        True,
        description="The reward model also predicts whether a frame ends the episode "
        "unsuccessfully (trained on the last frames of real episodes the env ended without "
        "success); imagined episodes end there as real ones do. false: they run to max_steps.",
    )
    failure_threshold: float = Field(
        0.9,
        gt=0,
        le=1,
        description="An imagined episode ends in failure (terminated, no terminal reward) when "
        "the failure head's probability reaches this and success was not reached.",
    )
    max_steps: int = Field(
        32, ge=1, description="Step cap of an imagined episode (truncated, bootstrapped)."
    )
    terminal_reward: float = Field(
        1.0,
        ge=0,
        description="Reward added to the potential-based reward p(o') - p(o) on the step an "
        "imagined episode ends in success.",
    )
    train_obs_every: int = Field(
        5,
        ge=0,
        description="T_obs: the world-model trainer fine-tunes M_obs after every T_obs-th policy "
        "step (with imagination on); 0: never (the pretrained M_obs stays).",
    )
    train_reward_every: int = Field(
        5, ge=0, description="T_reward: the same for M_reward; 0: never."
    )
    train_steps: int = Field(
        20, ge=1, description="Gradient steps of each model in one fine-tuning round."
    )
    batch_size: int = Field(
        32,
        ge=2,
        description="Samples per gradient step (M_reward: half success frames, or a quarter "
        "success and a quarter failure frames with the failure head).",
    )
    buffer_steps: int = Field(
        20000,
        ge=1,
        description="B_wm: real transitions the world-model trainer keeps, newest episodes first.",
    )
    max_batch: int = Field(
        16, ge=1, description="World-model service: most requests one forward pass answers."
    )
    max_wait_ms: float = Field(
        5.0, ge=0, description="World-model service: flush a batch this long after its oldest."
    )
    replicas: int = Field(
        1,
        ge=1,
        description="World-model service replicas, each a weight-sync receiver of the "
        "world-model trainer; rollout workers are spread over them in turn.",
    )
    ranks: int = Field(
        1,
        ge=1,
        description="World-model trainer ranks (data parallel over gloo/NCCL): each holds both "
        "models whole and trains on its share of every batch, gradients summed over ranks; "
        "rank 0 holds B_wm and publishes.",
    )
    resources: dict[str, float] = _resources("world-model trainer and service")

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        from relayrl.models.world_model import OBS_BACKENDS

        if value not in OBS_BACKENDS:
            raise ValueError(f"unknown backend; allowed: {', '.join(sorted(OBS_BACKENDS))}")
        return value

    @field_validator("path")
    @classmethod
    def _path_exists(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).is_dir():
            raise ValueError("directory does not exist")
        return value

    @model_validator(mode="after")
    def _sigma_range(self) -> WorldModelConfig:
        if self.sigma_min >= self.sigma_max:
            raise ValueError(f"sigma_min={self.sigma_min} must be < sigma_max={self.sigma_max}")
        return self


class ChannelsConfig(_Section):
    """Bounded channels between executors."""

    capacity: int = Field(1, ge=1, description="Batches a channel holds before put() waits.")


class SyncConfig(_Section):
    """Weight sync from the trainer to its receivers (see docs/architecture.md)."""

    transport: Literal["auto", "shm", "dist", "object_store", "disk"] = Field(
        "auto",
        description="auto: shm when trainer and generator share a host, dist across hosts.",
    )
    timeout_s: float = Field(
        60.0, gt=0, description="A receiver that takes no version within this is declared lost."
    )
    bucket_mb: int = Field(256, ge=1, description="Largest bucket a transport moves at once.")
    streams: int = Field(
        2,
        ge=1,
        description="dist: parallel gloo pairs per receiver; buckets alternate between them.",
    )
    in_place: bool = Field(
        False,
        description="dist only: the trainer's weights live in the send buffer, so a publish "
        "copies nothing and the trainer holds no second copy; its next optimizer step waits "
        "for the sends in flight (counted as stall).",
    )

    @model_validator(mode="after")
    def _in_place_needs_dist(self) -> SyncConfig:
        if self.in_place and self.transport != "dist":
            raise ValueError(
                f"sync.in_place=true needs sync.transport=dist, got {self.transport!r}"
            )
        return self


class LLMSyncConfig(SyncConfig):
    """llm: weight sync, with the precision the generators store the weights in."""

    precision: Literal["fp32", "bf16", "fp16", "int8", "fp8"] | None = Field(
        None,
        description="Generator precision, converted at the receiver (int8/fp8: weight-only, "
        "per-row scales); null keeps the trainer's.",
    )


class RayConfig(_Section):
    """Placement on Ray."""

    address: str | None = Field(
        None, description="Existing cluster to join (e.g. auto); null starts an embedded one."
    )
    num_cpus: int = Field(2, ge=1, description="CPUs of the embedded Ray instance.")
    threads_per_executor: int = Field(1, ge=1, description="torch threads in each executor.")


class LogConfig(_Section):
    """Metrics, progress and evaluation."""

    tensorboard: bool = Field(True, description="Write TensorBoard event files.")
    wandb_project: str | None = Field(
        None, description="Weights & Biases project to log to; null disables W&B."
    )
    wandb_mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline writes the W&B run under the run directory (sync it later with "
        "`wandb sync`); online needs network access and a login.",
    )

    @field_validator("wandb_project")
    @classmethod
    def _wandb_installed(cls, value: str | None) -> str | None:
        if value is not None and importlib.util.find_spec("wandb") is None:
            raise ValueError("W&B logging needs the wandb package: pip install 'relayrl[wandb]'")
        return value

    ess_warn_below: float = Field(
        0.3,
        ge=0,
        le=1,
        description="Warn when the importance weights' normalised effective sample size "
        "(loss/ess) stays under this for ess_warn_steps train steps in a row; 0 disables.",
    )
    ess_warn_steps: int = Field(5, ge=1, description="See ess_warn_below.")
    progress: bool = Field(True, description="Show a progress bar.")
    report: bool = Field(
        True,
        description="Write report.md and its plots when the run ends (about a second); "
        "`relayrl report RUN_DIR` builds them later either way.",
    )
    every: int = Field(10, ge=1, description="Log metrics every N RL steps.")
    eval_every: int = Field(
        0, ge=0, description="Evaluate held-out every N RL steps (0: only at the start and end)."
    )


# The sections that exist only while their feature is on: what turns each on, in the words of a
# refusal. Off, the section is None, and setting any of its options is refused.
FEATURES: dict[str, str] = {
    "reward_model": "no reward model is placed; reward_model.path places one",
    "reference": "no reference is placed; trainer.kl_coef > 0 places one",
    "critic": "no critic is placed; trainer.advantage=gae places one",
    "imagination": "imagination is off; imagination.episodes_per_real > 0 turns it on",
    "world_model": "the run has no world model; imagination.episodes_per_real > 0 places one "
    "(the relayrl wm commands read it too)",
}
# A feature switched on by a field of its own section: that field alone does not count as setting
# the section's options (reward_model.path=null, imagination.episodes_per_real=0 are fine).
SWITCHES = {"reward_model": "path", "imagination": "episodes_per_real"}


def _present(description: str) -> Any:
    """An optional section: None unless its feature is on."""
    return Field(None, description=description + "; null otherwise, and its options are refused.")


class Config(_Section):
    """A whole run: the sections every workload has. A run's config is an LLMConfig or an
    EmbodiedConfig (``parse_config`` picks by ``workload``), each with its own sections."""

    mode: Literal["sync", "async"] = Field(
        "async", description="sync: generate, score, train, publish in turn; async: overlapped."
    )
    steps: int = Field(
        600,
        ge=1,
        description="RL steps: batches the trainer consumes (at most one optimizer step each).",
    )
    max_staleness: int = Field(
        2, ge=0, description="Most policy versions a trained token (or env step) may lag."
    )
    placement: Literal["colocated", "distributed"] = Field(
        "colocated",
        description="colocated: every actor in one placement-group bundle, so all roles share "
        "a node (LlamaRL's co-located baseline); distributed: one bundle per actor, spread over "
        "the nodes that have the resources each role asks for.",
    )
    workload: Literal["llm", "embodied"] = Field(
        "llm",
        description="llm: a language model on prompts (model, task, generator, rewarder); "
        "embodied: a VLA policy in a simulator (env, rollout, inference, replay, vla, "
        "world_model). Each has its own sections; the other's are unknown keys.",
    )
    run: RunConfig = RunConfig()
    trainer: TrainerConfig = TrainerConfig()
    sync: SyncConfig = SyncConfig()
    ray: RayConfig = RayConfig()
    log: LogConfig = LogConfig()

    def features(self) -> set[str]:
        """The optional sections whose feature is on (see FEATURES)."""
        return set()

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> Config:
        if type(self) is Config:
            raise TypeError("Config is the base of LLMConfig and EmbodiedConfig; use parse_config")
        wanted = {"world_model"} if (info.context or {}).get("world_model") else set()
        _place_features(self, wanted)
        for rule in RULES[self.workload]:
            rule(self)
        return self


class LLMConfig(Config):
    """A run of a language model on prompts."""

    workload: Literal["llm"] = Field("llm", description="llm: a language model on prompts.")
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    warm_start: WarmStartConfig = WarmStartConfig()
    generator: GeneratorConfig = GeneratorConfig()
    rewarder: RewarderConfig = RewarderConfig()
    reward_model: RewardModelConfig | None = _present(
        "llm: the reward model, present when reward_model.path is set (it places the "
        "reward_model role)"
    )
    reward_models: list[RewardModelStageConfig] = Field(
        default_factory=list,
        description="llm: more reward-model stages, each {name, path, weight, ...} as in "
        "reward_model, placed in this order after the rewarder (and reward_model); each one's "
        "name is its role.",
    )
    reference: ReferenceConfig | None = _present(
        "llm: the reference policy of the KL term, present when trainer.kl_coef > 0"
    )
    critic: CriticConfig | None = _present(
        "llm: the value model, present when trainer.advantage=gae"
    )
    trainer: LLMTrainerConfig = LLMTrainerConfig()
    channels: ChannelsConfig = ChannelsConfig()
    sync: LLMSyncConfig = LLMSyncConfig()
    experiment: LLMExperimentConfig = Field(
        LLMExperimentConfig(), description="llm: switches that only studies and tests flip."
    )

    def features(self) -> set[str]:
        """The optional sections whose feature is on (see FEATURES)."""
        on = set()
        if self.reward_model is not None and self.reward_model.path is not None:
            on.add("reward_model")
        if self.trainer.kl_coef > 0:
            on.add("reference")
        if self.trainer.advantage == "gae":
            on.add("critic")
        return on


class EmbodiedConfig(Config):
    """A run of a VLA policy in a simulator."""

    workload: Literal["embodied"] = Field(
        "embodied", description="embodied: a VLA policy in a simulator."
    )
    trainer: EmbodiedTrainerConfig = EmbodiedTrainerConfig()
    env: EnvConfig = EnvConfig()
    rollout: RolloutConfig = RolloutConfig()
    inference: InferenceConfig = InferenceConfig()
    replay: ReplayConfig = ReplayConfig()
    vla: VLAModelConfig = VLAModelConfig()
    world_model: WorldModelConfig | None = _present(
        "embodied: the world model, present with imagination (and for the relayrl wm commands)"
    )
    imagination: ImaginationConfig | None = _present(
        "embodied: imagination (AcceRL-WM), present when imagination.episodes_per_real > 0"
    )
    experiment: EmbodiedExperimentConfig = Field(
        EmbodiedExperimentConfig(), description="embodied: switches that only studies flip."
    )

    def features(self) -> set[str]:
        """The optional sections whose feature is on (see FEATURES)."""
        if self.imagination is not None and self.imagination.episodes_per_real > 0:
            return {"imagination", "world_model"}
        return set()


CONFIGS: dict[str, type[Config]] = {"llm": LLMConfig, "embodied": EmbodiedConfig}
"""The config model of each workload."""
_ANY_CONFIG = TypeAdapter(Annotated[LLMConfig | EmbodiedConfig, Field(discriminator="workload")])


def _features_of(cfg: Config) -> list[str]:
    """The optional sections (``FEATURES``) the config's workload has."""
    return [name for name in FEATURES if name in type(cfg).model_fields]


def _place_features(cfg: Config, wanted: set[str]) -> None:
    """Each optional section is its defaults while its feature is on and None while it is off;
    an option set while it is off is refused, naming what turns it on. ``wanted``: sections the
    caller reads whatever the run places (the world model of the relayrl wm commands)."""
    names = _features_of(cfg)
    on = cfg.features() | (wanted & set(names))
    for name in names:
        section = getattr(cfg, name)
        if name in on:
            if section is None:
                # Not an assignment: that would validate the whole Config again.
                model = _section_model(type(cfg).model_fields[name].annotation)
                cfg.__dict__[name] = model()
            continue
        if section is None:
            continue
        given = [f for f in type(section).model_fields if f in section.model_fields_set]
        given = [f for f in given if f != SWITCHES.get(name)]
        if given:
            value = getattr(section, given[0])
            raise ValueError(f"{name}.{given[0]} = {value!r}: {FEATURES[name]}")
        cfg.__dict__[name] = None


def _diffusion(cfg: Config) -> bool:
    return cfg.world_model is not None and cfg.world_model.backend == "diffusion"


_DIFFUSION = ("world_model.backend=diffusion", _diffusion)
# Options read only under a setting: the setting, in words, and whether it holds. Given while it
# does not, they are refused, and a saved config leaves them out.
SETTINGS: dict[str, tuple[str, Callable[[Config], bool]]] = {
    "trainer.proximal_weight_cap": (
        "trainer.proximal=current",
        lambda cfg: cfg.trainer.proximal == "current",
    ),
    "trainer.kl_estimator": ("trainer.kl_coef > 0", lambda cfg: cfg.trainer.kl_coef > 0),
    "trainer.kl_in": ("trainer.kl_coef > 0", lambda cfg: cfg.trainer.kl_coef > 0),
    "log.wandb_mode": ("log.wandb_project", lambda cfg: cfg.log.wandb_project is not None),
    "trainer.lr_final_ratio": (
        "trainer.lr_schedule=cosine",
        lambda cfg: cfg.trainer.lr_schedule == "cosine",
    ),
    **{
        f"task.{name}": ("task.name=dataset", lambda cfg: cfg.task.name == "dataset")
        for name in ("data", "prompt_field", "answer_field", "template")
    },
    **{
        f"task.{name}": ("task.name=chain_sum", lambda cfg: cfg.task.name == "chain_sum")
        for name in ("terms_max", "tail")
    },
    **{
        f"rewarder.{name}": (
            "rewarder.scorer=math or a module:function rule",
            lambda cfg: cfg.rewarder.scorer != "exact_answer",
        )
        for name in ("workers", "timeout_s", "memory_mb")
    },
    "env.latency_mean_ms": ("env.latency other than none", lambda cfg: cfg.env.latency != "none"),
    "env.latency_sigma": ("env.latency=lognormal", lambda cfg: cfg.env.latency == "lognormal"),
    "env.suite": ("env.name=libero", lambda cfg: cfg.env.name == "libero"),
    "world_model.failure_threshold": (
        "world_model.failure_head=true",
        lambda cfg: cfg.world_model is not None and cfg.world_model.failure_head,
    ),
    **{
        f"world_model.{name}": _DIFFUSION
        for name in (
            "denoising_steps",
            "sigma_data",
            "sigma_min",
            "sigma_max",
            "rho",
            "train_sigma_loc",
            "train_sigma_scale",
            "context_noise",
        )
    },
}


def _options_belong_to_their_setting(cfg: Config) -> None:
    """An option read only under a setting (``SETTINGS``) is refused while it does not hold."""
    for key, given, name, setting in _settings_off(cfg):
        if name in given.model_fields_set:
            raise ValueError(
                f"{key} = {getattr(given, name)!r}: read only with {setting}; remove it or set "
                f"{setting}"
            )


def _settings_off(cfg: Config) -> list[tuple[str, BaseModel, str, str]]:
    """The options of ``SETTINGS`` the config has whose setting does not hold: (key, section,
    field name, setting)."""
    off = []
    for key, (setting, holds) in SETTINGS.items():
        section, _, name = key.partition(".")
        given = getattr(cfg, section, None)
        if given is not None and name in type(given).model_fields and not holds(cfg):
            off.append((key, given, name, setting))
    return off


def _loss_options_belong_to_the_loss(cfg: Config) -> None:
    """A loss's options (``LOSS_OPTIONS``) are refused with any other loss."""
    from relayrl.algorithms.losses import LOSS_OPTIONS

    tc = cfg.trainer
    owners: dict[str, list[str]] = {}
    for loss, options in LOSS_OPTIONS.items():
        for field in options.values():
            owners.setdefault(field, []).append(loss)
    mine = set(LOSS_OPTIONS.get(tc.loss, {}).values())
    for field in TrainerConfig.model_fields:
        if field in owners and field not in mine and field in tc.model_fields_set:
            losses = owners[field]
            raise ValueError(
                f"trainer.{field} = {getattr(tc, field)!r}: an option of loss "
                f"{' and '.join(losses)}, not of trainer.loss={tc.loss}; remove it or set "
                f"trainer.loss={losses[0]}"
            )


def _patch_divides_the_image(cfg: Config) -> None:
    """The VLA cuts each frame into whole patches."""
    if cfg.env.image_size % cfg.vla.patch_size:
        raise ValueError(
            f"env.image_size={cfg.env.image_size} must be a multiple of "
            f"vla.patch_size={cfg.vla.patch_size}"
        )


def _world_model_fits_the_image(cfg: Config) -> None:
    """The observation U-Net halves the frame ``levels`` times, the reward model twice."""
    if cfg.world_model is None:
        return
    multiple = max(2**cfg.world_model.levels, 4)
    if cfg.env.image_size % multiple:
        raise ValueError(
            f"env.image_size={cfg.env.image_size} must be a multiple of {multiple} for the "
            f"world model (2**world_model.levels={2**cfg.world_model.levels}, and 4)"
        )


def _imagination_needs_async(cfg: Config) -> None:
    """Workers imagine in their own loops, which only async mode runs."""
    if cfg.imagination is not None and cfg.mode != "async":
        raise ValueError(
            f"imagination.episodes_per_real={cfg.imagination.episodes_per_real} needs "
            f"mode=async (got mode={cfg.mode}): workers imagine in their own loops"
        )


def _real_share(cfg: Config) -> int:
    """Env steps of each super-batch taken from the real replay buffer."""
    steps = cfg.replay.batch_steps
    return steps if cfg.imagination is None else round(cfg.imagination.real_ratio * steps)


def _waiting_workers_have_a_reader(cfg: Config) -> None:
    """Workers that wait at replay.wait_at wait for the trainer's next read of the real buffer."""
    if cfg.imagination is not None and cfg.replay.wait_at is not None and not _real_share(cfg):
        raise ValueError(
            f"replay.wait_at={cfg.replay.wait_at} with imagination.real_ratio="
            f"{cfg.imagination.real_ratio}: the trainer takes no real env steps "
            f"(round(real_ratio * replay.batch_steps) = 0), so workers would wait for it "
            "forever; set replay.wait_at=null or imagination.real_ratio > 0"
        )


def _imagined_share_fits_its_buffer(cfg: Config) -> None:
    """A fetch takes the imagined share of a super-batch from B_img at once."""
    if cfg.imagination is None:
        return
    imagined = cfg.replay.batch_steps - _real_share(cfg)
    if imagined > cfg.imagination.buffer_steps:
        raise ValueError(
            f"imagination.buffer_steps={cfg.imagination.buffer_steps} must be >= the imagined "
            f"share of a super-batch, (1 - imagination.real_ratio) * replay.batch_steps = "
            f"{imagined}; raise imagination.buffer_steps or imagination.real_ratio, or lower "
            "replay.batch_steps"
        )


def _inference_lag_within_staleness(cfg: Config) -> None:
    """A forced inference lag beyond max_staleness would drop every segment."""
    lag = cfg.inference.min_lag
    if cfg.max_staleness < lag:
        raise ValueError(
            f"max_staleness={cfg.max_staleness} must be >= inference.min_lag={lag}: the "
            "trainer would drop every segment the forced lag makes"
        )


def _inference_lag_needs_held_copies(cfg: Config) -> None:
    """A forced inference lag publishes copies, which in-place sync does not have."""
    lag = cfg.inference.min_lag
    if lag and cfg.sync.in_place:
        raise ValueError(
            f"inference.min_lag={lag} publishes held copies of older weights, but "
            "sync.in_place=true sends the live parameters; set sync.in_place=false"
        )


def _generator_lag_within_staleness(cfg: Config) -> None:
    """A forced generator lag beyond max_staleness would drop every batch."""
    lag = cfg.generator.min_lag
    if cfg.max_staleness < lag:
        raise ValueError(
            f"max_staleness={cfg.max_staleness} must be >= generator.min_lag={lag}: the "
            "trainer would drop every batch the forced lag makes"
        )


def _generator_lag_fits_the_channels(cfg: Config) -> None:
    """In async mode the lagged batches wait in the channels."""
    lag = cfg.generator.min_lag
    if cfg.mode == "async" and cfg.channels.capacity < lag:
        raise ValueError(
            f"channels.capacity={cfg.channels.capacity} must be >= generator.min_lag={lag} "
            "in async mode: a batch waits in the channels until min_lag younger ones started"
        )


def _fused_recompute_settings(cfg: Config) -> None:
    """Fused recompute computes advantages inside each micro-batch's training pass."""
    tc = cfg.trainer
    if tc.value_recompute != "fused":
        return
    needs = {"epochs": 1, "minibatch_order": "sequential", "adv_norm": "lagged_welford"}
    wrong = {k: v for k, v in needs.items() if getattr(tc, k) != v}
    if wrong:
        raise ValueError(
            "trainer.value_recompute=fused computes each micro-batch's advantages in its "
            "own training forward pass, so it needs "
            + ", ".join(f"trainer.{k}={v}" for k, v in needs.items())
            + "; got "
            + ", ".join(f"trainer.{k}={getattr(tc, k)}" for k in wrong)
        )


def _current_proximal_needs_the_value_pass(cfg: Config) -> None:
    """proximal=current takes the old policy's log-probs from the value pass."""
    tc = cfg.trainer
    if tc.proximal == "current" and tc.value_recompute != "pass":
        raise ValueError(
            f"trainer.proximal=current takes the old policy's log-probs from the value pass, "
            f"so it needs trainer.value_recompute=pass; got {tc.value_recompute}"
        )


def _minibatches_fit_the_groups(cfg: Config) -> None:
    """Each of a step's minibatches is a block of whole groups."""
    minibatches, groups = cfg.trainer.minibatches, cfg.generator.prompts_per_step
    if minibatches > groups:
        raise ValueError(
            f"trainer.minibatches={minibatches} is more than a step's groups "
            f"(generator.prompts_per_step={groups}): each minibatch is a block of whole groups"
        )


def _vcpo_baseline_weighs_as_tis_seq(cfg: Config) -> None:
    """VCPO's baseline weighs each sequence by the weight tis_seq's loss gives it."""
    tc = cfg.trainer
    if tc.advantage == "vcpo_baseline" and (tc.loss != "tis_seq" or tc.proximal != "behaviour"):
        raise ValueError(
            "trainer.advantage=vcpo_baseline weighs each sequence by the weight tis_seq gives "
            "it, min(prod pi/mu, trainer.seq_is_cap): it needs trainer.loss=tis_seq and "
            f"trainer.proximal=behaviour; got trainer.loss={tc.loss}, "
            f"trainer.proximal={tc.proximal}"
        )


def _gae_takes_the_kl_in_the_loss(cfg: Config) -> None:
    """The critic computes GAE before the trainer's KL shaping of the rewards."""
    tc = cfg.trainer
    if tc.advantage == "gae" and tc.kl_coef > 0 and tc.kl_in == "reward":
        raise ValueError(
            "trainer.advantage=gae with trainer.kl_in=reward is not supported: the critic "
            "computes GAE from the rewards before the trainer's KL shaping; use "
            "trainer.kl_in=loss"
        )


def _several_envs_need_async(cfg: Config) -> None:
    """The lockstep loop of sync mode steps one env per worker."""
    if cfg.mode == "sync" and cfg.rollout.envs_per_worker > 1:
        raise ValueError(
            f"rollout.envs_per_worker={cfg.rollout.envs_per_worker} needs mode=async: the "
            "lockstep loop steps one env per worker; use rollout.workers instead"
        )


def _int8_generator_needs_int8_storage(cfg: Config) -> None:
    """The int8 generator computes with the int8 weights its receiver stores."""
    if cfg.generator.precision == "int8" and cfg.sync.precision not in (None, "int8"):
        raise ValueError(
            f"generator.precision=int8 computes with the int8 weights the receiver stores, "
            f"but sync.precision={cfg.sync.precision} stores them otherwise; set "
            "sync.precision to int8 or null (null: int8, as generator.precision says)"
        )


def _in_place_sync_needs_one_rank(cfg: Config) -> None:
    """FSDP2 owns sharded parameters' memory, which in-place sync would bind."""
    if cfg.sync.in_place and cfg.trainer.ranks > 1:
        raise ValueError(
            f"sync.in_place=true with trainer.ranks={cfg.trainer.ranks}: FSDP2 owns the "
            "memory of sharded parameters, so they cannot be bound into the send buffer; "
            "use sync.in_place=false or trainer.ranks=1"
        )


def _reward_model_names_are_unique(cfg: Config) -> None:
    """Each reward_models entry names a role of its own."""
    names = [rm.name for rm in cfg.reward_models]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ValueError(
                f"reward_models.{i}.name = {name!r}: reward_models.{names.index(name)} has this "
                "name; each reward model needs its own"
            )


# The checks across sections of each workload, in the order they run after the sections are
# placed; each raises one line naming its fields and what would make them valid.
_EVERY_RUN = (_loss_options_belong_to_the_loss, _options_belong_to_their_setting)
RULES: dict[str, tuple[Callable[[Any], None], ...]] = {
    "llm": (
        *_EVERY_RUN,
        _reward_model_names_are_unique,
        _generator_lag_within_staleness,
        _generator_lag_fits_the_channels,
        _minibatches_fit_the_groups,
        _vcpo_baseline_weighs_as_tis_seq,
        _gae_takes_the_kl_in_the_loss,
        _int8_generator_needs_int8_storage,
        _in_place_sync_needs_one_rank,
    ),
    "embodied": (
        *_EVERY_RUN,
        _patch_divides_the_image,
        _world_model_fits_the_image,
        _imagination_needs_async,
        _waiting_workers_have_a_reader,
        _imagined_share_fits_its_buffer,
        _inference_lag_within_staleness,
        _inference_lag_needs_held_copies,
        _fused_recompute_settings,
        _current_proximal_needs_the_value_pass,
        _several_envs_need_async,
        _in_place_sync_needs_one_rank,
    ),
}


def load_config(
    path: str | Path | None,
    overrides: list[str] | tuple[str, ...] = (),
    presets: Sequence[str | Path] = (),
    *,
    world_model: bool = False,
) -> Config:
    """Load a YAML config, merge ``presets`` (YAML files of the same shape) over it in order, apply
    ``a.b=c`` overrides and validate; raise ConfigError on problems. ``world_model``: the caller
    reads the world_model section whether or not the run imagines (the relayrl wm commands)."""
    tree: dict[str, Any] = _read_yaml(path, "config file") if path is not None else {}
    layers = [_read_yaml(preset, "preset") for preset in presets]
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' must look like a.b=value")
    for item in overrides:
        try:
            yaml.safe_load(item.split("=", 1)[1])
        except yaml.YAMLError:
            key, value = item.split("=", 1)
            raise ConfigError(
                f"{key} = {value!r}: not a valid YAML value; quote it, e.g. {key}='{value}'"
            ) from None
    merged = _merge(tree, layers, overrides)
    # A preset's loss options apply with its loss: a later trainer.loss leaves them out.
    layers = [_for_loss(layer, _final_loss(merged)) for layer in layers]
    merged = _merge(tree, layers, overrides)
    return parse_config(merged, world_model=world_model)


def parse_config(tree: dict[str, Any], *, world_model: bool = False) -> Config:
    """The LLMConfig or EmbodiedConfig a mapping describes, by its ``workload`` (llm when unset);
    ConfigError naming the first problem. ``world_model``: as for ``load_config``."""
    tree = {"workload": "llm", **tree}
    if not isinstance(tree["workload"], str) or tree["workload"] not in CONFIGS:
        allowed = " or ".join(repr(name) for name in CONFIGS)
        raise ConfigError(f"workload = {tree['workload']!r}: Input should be {allowed}")
    try:
        return _ANY_CONFIG.validate_python(tree, context={"world_model": world_model})
    except ValidationError as err:
        raise ConfigError(_describe(err)) from None


def _merge(tree: dict[str, Any], layers: list[dict], overrides: Sequence[str]) -> dict[str, Any]:
    """The config file, the presets over it in order, then the overrides, as one mapping."""
    try:
        merged = OmegaConf.merge(
            OmegaConf.create(tree),
            *(OmegaConf.create(layer) for layer in layers),
            OmegaConf.from_dotlist(list(overrides)),
        )
        return OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as err:
        raise ConfigError(str(err).splitlines()[0]) from None


def _final_loss(tree: dict[str, Any]) -> Any:
    """The loss a merged mapping chooses, given or the workload's default."""
    trainer = tree.get("trainer")
    if isinstance(trainer, dict) and "loss" in trainer:
        return trainer["loss"]
    config = CONFIGS.get(tree.get("workload", "llm"), LLMConfig)
    return config.model_fields["trainer"].default.loss


def _for_loss(layer: dict[str, Any], loss: Any) -> dict[str, Any]:
    """A preset without the options of losses other than ``loss``."""
    from relayrl.algorithms.losses import LOSS_OPTIONS

    trainer = layer.get("trainer")
    if not isinstance(trainer, dict):
        return layer
    mine = set(LOSS_OPTIONS.get(loss, {}).values()) if isinstance(loss, str) else set()
    others = {f for options in LOSS_OPTIONS.values() for f in options.values()} - mine
    return layer | {"trainer": {k: v for k, v in trainer.items() if k not in others}}


def _read_yaml(path: str | Path, kind: str) -> dict[str, Any]:
    """The mapping a YAML file holds (empty for an empty file); ConfigError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{kind} '{path}' not found")
    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"{kind} '{path}' is not readable YAML: {_yaml_problem(err)}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{kind} '{path}' must hold a mapping, got {type(loaded).__name__}")
    return loaded or {}


def preset_path(name: str, config: str | Path | None) -> Path:
    """A preset given by path, or by name: ``presets/NAME.yaml`` beside the config file (the
    shipped ones are in ``configs/presets/``)."""
    if Path(name).suffix in (".yaml", ".yml") or Path(name).is_file():
        return Path(name)
    folder = Path(config).parent if config is not None else Path("configs")
    return folder / "presets" / f"{name}.yaml"


def _yaml_problem(err: Exception) -> str:
    """One line for a read or parse error; PyYAML's own message spans several lines."""
    mark = getattr(err, "problem_mark", None)
    if mark is not None:
        return f"{err.problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(err).split())


def _describe(err: ValidationError) -> str:
    """One line per the first validation error: field, value, what is allowed."""
    first = err.errors()[0]
    workload, *loc = first["loc"]  # the union's tag comes first
    where = ".".join(str(part) for part in loc)
    value = first.get("input")
    if first["type"] == "extra_forbidden":
        other = next(name for name in CONFIGS if name != workload)
        if where in MOVED:
            section, _, name = MOVED[where].rpartition(".")
            if name in (_fields_at(CONFIGS[str(workload)], section.split(".")) or []):
                return f"{where}: moved to {MOVED[where]}"
            return f"{where}: moved to {MOVED[where]}, which only workload={other!r} reads"
        if loc and str(loc[-1]) in (_fields_at(CONFIGS[other], loc[:-1]) or []):
            return (
                f"{where}: does not apply to workload={workload!r} (only workload={other!r} "
                f"reads it); remove it or set workload={other}"
            )
        allowed = ", ".join(_fields_at(CONFIGS[str(workload)], loc[:-1]) or [])
        return f"{where}: unknown key (allowed here: {allowed})"
    if first["type"] == "missing":
        return f"{where}: required, not given"
    message = first["msg"].removeprefix("Value error, ")
    if not where:  # a check across sections names its fields itself
        return message
    more = f" (and {len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return f"{where} = {value!r}: {message}{more}"


def _fields_at(model: Any, loc: Sequence[Any]) -> list[str] | None:
    """The fields of the section at ``loc`` under ``model``; None where there is none."""
    for part in loc:
        if isinstance(part, int):  # an entry of a list of sections
            continue
        field = model.model_fields.get(str(part)) if isinstance(model, type) else None
        if field is None or not hasattr(model, "model_fields"):
            return None
        model = _section_model(field.annotation)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return None
    return list(model.model_fields)


def _section_model(annotation: Any) -> Any:
    """The model of a section's annotation (``X`` of an optional ``X | None``); else itself."""
    models = [a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if models else annotation


def save_config(config: Config, path: Path) -> None:
    """Write the resolved config as YAML, without what its run does not read: the sections of
    features that are off, the other losses' options and the options of settings that are off."""
    from relayrl.algorithms.losses import LOSS_OPTIONS

    exclude: dict[str, Any] = {
        name: True for name in _features_of(config) if getattr(config, name) is None
    }
    mine = set(LOSS_OPTIONS.get(config.trainer.loss, {}).values())
    others = {f for options in LOSS_OPTIONS.values() for f in options.values()} - mine
    exclude["trainer"] = others
    if isinstance(config, LLMConfig) and not config.reward_models:
        exclude["reward_models"] = True
    for key, _, name, _ in _settings_off(config):
        exclude.setdefault(key.partition(".")[0], set()).add(name)
    tree = config.model_dump(mode="json", exclude=exclude)
    path.write_text(yaml.safe_dump(tree, sort_keys=False))


def reference_markdown() -> str:
    """The config reference as Markdown tables generated from the models above: the options of
    every run, then those of each workload (a key whose row differs between them is in both)."""
    rows = {name: _reference_rows(model) for name, model in CONFIGS.items()}
    base = _reference_rows(Config)
    common = [k for k in base if k == "workload" or all(r.get(k) == base[k] for r in rows.values())]
    header = ["| key | type | default | description |", "|---|---|---|---|"]
    lines = ["Every run:", "", *header, *(base[k] for k in common)]
    for name, own in rows.items():
        lines += ["", f"`workload: {name}`:", "", *header]
        lines += [row for key, row in own.items() if key not in common]
    lines += ["", "Options that moved (the old key is refused naming the new one):", ""]
    lines += ["| was | now |", "|---|---|"]
    lines += [f"| `{old}` | `{new}` |" for old, new in MOVED.items()]
    return "\n".join(lines) + "\n"


def _reference_rows(config: type[BaseModel]) -> dict[str, str]:
    """The reference's table row of each option of ``config``, by dotted key."""
    lines: dict[str, str] = {}

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            key = f"{prefix}{name}"
            annotation = _section_model(field.annotation)
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                if get_origin(field.annotation) is list:
                    lines[key] = f"| `{key}` | list of sections | `[]` | {field.description} |"
                    walk(annotation, key + "[].")
                    continue
                if annotation is not field.annotation:  # an optional section: when it is there
                    lines[key] = f"| `{key}` | section or null | `null` | {field.description} |"
                walk(annotation, key + ".")
                continue
            default = (
                "required"
                if field.is_required()
                else json.dumps(field.get_default(call_default_factory=True))
            )
            lines[key] = f"| `{key}` | {_kind(annotation)} | `{default}` | {field.description} |"

    walk(config, "")
    return lines


def _kind(annotation: Any) -> str:
    if get_origin(annotation) is list:
        return f"list of {_kind(get_args(annotation)[0])}"
    if get_origin(annotation) is dict:
        key, value = get_args(annotation)
        return f"map of {_kind(key)} to {_kind(value)}"
    if get_origin(annotation) is Literal:
        return " or ".join(json.dumps(choice) for choice in get_args(annotation))
    if get_args(annotation):
        return " or ".join(_kind(arg) for arg in get_args(annotation))
    return "null" if annotation is type(None) else annotation.__name__
