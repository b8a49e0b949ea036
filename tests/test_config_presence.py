"""Config by presence: a feature's section exists only while the feature is on, a loss's options
belong to that loss, and each rule across sections refuses in one line before Ray starts."""

from pathlib import Path

import pytest
import yaml

from relayrl import cli
from relayrl.config import (
    CONFIGS,
    FEATURES,
    RULES,
    Config,
    ConfigError,
    load_config,
    save_config,
)

REPO = Path(__file__).resolve().parents[1]
ARITH = REPO / "configs" / "arith.yaml"
BABYAI = REPO / "configs" / "babyai.yaml"
BABYAI_WM = REPO / "configs" / "babyai_wm.yaml"
EMBODIED = ["workload=embodied"]


def refusal(path, overrides=(), **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides, **kwargs)
    message = str(info.value)
    assert message and "\n" not in message, message
    return message


@pytest.mark.parametrize(
    ("path", "overrides", "expected"),
    [
        (
            BABYAI,
            ["imagination.episodes_per_real=2"],
            "replay.wait_at=1 with imagination.real_ratio=0.0: the trainer takes no real env "
            "steps (round(real_ratio * replay.batch_steps) = 0), so workers would wait for it "
            "forever; set replay.wait_at=null or imagination.real_ratio > 0",
        ),
        (
            BABYAI_WM,
            ["replay.batch_steps=4096", "imagination.buffer_steps=1024"],
            # (1 - 0.25) * 4096 = 3072 imagined steps per fetch, B_img holds 1024
            "imagination.buffer_steps=1024 must be >= the imagined share of a super-batch, "
            "(1 - imagination.real_ratio) * replay.batch_steps = 3072; raise "
            "imagination.buffer_steps or imagination.real_ratio, or lower replay.batch_steps",
        ),
        (
            ARITH,
            ["trainer.gipo_sigma=0.5"],
            "trainer.gipo_sigma = 0.5: an option of loss gipo, not of trainer.loss=aipo; "
            "remove it or set trainer.loss=gipo",
        ),
        (
            ARITH,
            ["critic.lr=1e-4"],
            "critic.lr = 0.0001: no critic is placed; trainer.advantage=gae places one",
        ),
    ],
)
def test_train_refuses_in_one_line_before_ray_starts(
    path, overrides, expected, monkeypatch, capsys
):
    import relayrl.launch

    started = []
    monkeypatch.setattr(relayrl.launch, "start_ray", lambda *a, **k: started.append(a))
    assert cli.main(["train", str(path), *overrides]) == 2
    assert capsys.readouterr().err == f"relayrl: config error: {expected}\n"
    assert not started


def test_a_run_without_a_world_model_takes_an_image_size_only_the_vla_checks():
    cfg = load_config(BABYAI, ["env.image_size=42", "vla.patch_size=6"])
    assert cfg.world_model is None and cfg.env.image_size == 42  # 42 = 7 patches of 6
    message = refusal(BABYAI_WM, ["env.image_size=42", "vla.patch_size=6"])
    assert message.startswith("env.image_size=42 must be a multiple of 4 for the world model")


@pytest.mark.parametrize(
    ("overrides", "on"),
    [
        ([], set()),
        (["reward_model.path=."], {"reward_model"}),
        (["trainer.kl_coef=0.1"], {"reference"}),
        (["trainer.advantage=gae"], {"critic"}),
        (["trainer.advantage=gae", "trainer.kl_coef=0.1"], {"critic", "reference"}),
        (EMBODIED, set()),
        ([*EMBODIED, "imagination.episodes_per_real=1"], {"imagination", "world_model"}),
    ],
)
def test_a_section_is_there_exactly_while_its_feature_is_on(overrides, on):
    cfg = load_config(None, overrides)
    for name in FEATURES:
        section = getattr(cfg, name, None)
        assert (section is not None) == (name in on), name
        if section is not None:  # its defaults, where nothing set them
            model = type(section)
            assert section.model_dump(exclude={"path", "episodes_per_real"}) == model().model_dump(
                exclude={"path", "episodes_per_real"}
            )


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["reward_model.weight=2"], "reward_model.weight = 2.0: no reward model is placed; "),
        (["reference.dtype=bf16"], "reference.dtype = 'bf16': no reference is placed; "),
        (["critic.lam=1"], "critic.lam = 1.0: no critic is placed; trainer.advantage=gae"),
        (
            [*EMBODIED, "imagination.real_ratio=0.5"],
            "imagination.real_ratio = 0.5: imagination is off; imagination.episodes_per_real > 0",
        ),
        (
            [*EMBODIED, "world_model.lr=0.01"],
            "world_model.lr = 0.01: the run has no world model; imagination.episodes_per_real > 0",
        ),
    ],
)
def test_an_option_of_a_feature_that_is_off_is_refused_naming_what_turns_it_on(overrides, expected):
    assert refusal(None, overrides).startswith(expected)


def test_the_switch_of_a_feature_off_is_no_option_set():
    cfg = load_config(None, ["reward_model.path=null", "critic=null"])
    assert cfg.reward_model is None and cfg.critic is None
    assert load_config(None, [*EMBODIED, "imagination.episodes_per_real=0"]).imagination is None


def test_the_options_of_a_feature_that_is_on_are_kept():
    cfg = load_config(None, ["trainer.advantage=gae", "critic.lam=1", "trainer.kl_coef=0.1"])
    assert cfg.critic.lam == 1.0 and cfg.reference.dtype == "fp32"


def test_the_wm_commands_read_the_world_model_of_a_run_without_imagination():
    cfg = load_config(BABYAI, ["world_model.lr=0.01"], world_model=True)
    assert cfg.world_model.lr == 0.01 and cfg.imagination is None
    assert not hasattr(load_config(ARITH, [], world_model=True), "world_model")  # llm: never


def test_a_saved_config_leaves_out_what_its_run_does_not_read_and_loads_again(tmp_path):
    cfg = load_config(ARITH, ["trainer.loss=gipo", "trainer.advantage=gae"])
    saved = tmp_path / "config.yaml"
    save_config(cfg, saved)
    written = yaml.safe_load(saved.read_text())
    assert "critic" in written and not {"reference", "reward_model"} & set(written)
    assert {"gipo_sigma", "gipo_neg_ratio"} <= set(written["trainer"])
    assert not {"aipo_rho", "ppo_clip_eps", "m2po_tau"} & set(written["trainer"])
    assert load_config(saved) == cfg


@pytest.mark.parametrize(
    ("loss", "option", "owners"),
    [
        ("aipo", "ppo_clip_eps", "ppo_clip and geo_mask"),
        ("ppo_clip", "aipo_rho", "aipo and aipo_clamp and ess_aipo"),
        ("pg", "seq_mis_lower", "mis_seq and mis_seq_verl"),
        ("gipo", "m2po_tau", "m2po"),
        ("m2po", "seq_is_cap", "tis_seq"),
    ],
)
def test_a_loss_option_is_refused_with_another_loss_naming_its_own(loss, option, owners):
    message = refusal(None, [f"trainer.loss={loss}", f"trainer.{option}=0.3"])
    first = owners.split(" and ")[0]
    assert message == (
        f"trainer.{option} = 0.3: an option of loss {owners}, not of trainer.loss={loss}; "
        f"remove it or set trainer.loss={first}"
    )
    assert (
        getattr(
            load_config(None, [f"trainer.loss={first}", f"trainer.{option}=0.3"]).trainer, option
        )
        == 0.3
    )


def test_an_embodied_run_takes_the_options_of_its_default_loss():
    cfg = load_config(None, [*EMBODIED, "trainer.gipo_sigma=0.2"])
    assert cfg.trainer.loss == "gipo" and cfg.trainer.gipo_sigma == 0.2
    assert "gipo" in refusal(None, [*EMBODIED, "trainer.loss=ppo_clip", "trainer.gipo_sigma=0.2"])


# One refusal per rule across sections: the overrides (over the defaults) and what the line says.
REFUSALS = {
    "_reward_model_names_are_unique": (
        ["reward_models=[{name: rm, path: .}, {name: rm, path: .}]"],
        "reward_models.1.name = 'rm': reward_models.0 has this name",
    ),
    "_loss_options_belong_to_the_loss": (["trainer.m2po_tau=0.1"], "an option of loss m2po"),
    "_options_belong_to_their_setting": (
        ["trainer.kl_in=reward"],
        "trainer.kl_in = 'reward': read only with trainer.kl_coef > 0; remove it or set "
        "trainer.kl_coef > 0",
    ),
    "_patch_divides_the_image": (
        [*EMBODIED, "env.image_size=60"],
        "env.image_size=60 must be a multiple of vla.patch_size=8",
    ),
    "_world_model_fits_the_image": (
        [*EMBODIED, "env.image_size=20", "vla.patch_size=4", "world_model.levels=3"]
        + ["imagination.episodes_per_real=1"],
        "env.image_size=20 must be a multiple of 8 for the world model",
    ),
    "_imagination_needs_async": (
        [*EMBODIED, "mode=sync", "imagination.episodes_per_real=1"],
        "imagination.episodes_per_real=1 needs mode=async (got mode=sync)",
    ),
    "_waiting_workers_have_a_reader": (
        [*EMBODIED, "replay.wait_at=8", "imagination.episodes_per_real=1"],
        "replay.wait_at=8 with imagination.real_ratio=0.0",
    ),
    "_imagined_share_fits_its_buffer": (
        [*EMBODIED, "imagination.episodes_per_real=1", "imagination.buffer_steps=511"],
        "imagination.buffer_steps=511 must be >= the imagined share of a super-batch, "
        "(1 - imagination.real_ratio) * replay.batch_steps = 512",
    ),
    "_inference_lag_within_staleness": (
        [*EMBODIED, "inference.min_lag=3"],
        "max_staleness=2 must be >= inference.min_lag=3",
    ),
    "_inference_lag_needs_held_copies": (
        [*EMBODIED, "inference.min_lag=1", "sync.transport=dist", "sync.in_place=true"],
        "inference.min_lag=1 publishes held copies of older weights",
    ),
    "_generator_lag_within_staleness": (
        ["generator.min_lag=3"],
        "max_staleness=2 must be >= generator.min_lag=3",
    ),
    "_generator_lag_fits_the_channels": (
        ["generator.min_lag=2"],
        "channels.capacity=1 must be >= generator.min_lag=2 in async mode",
    ),
    "_fused_recompute_settings": (
        [*EMBODIED, "trainer.value_recompute=fused"],
        "got trainer.epochs=2, trainer.minibatch_order=shuffled, trainer.adv_norm=batch",
    ),
    "_current_proximal_needs_the_value_pass": (
        [*EMBODIED, "trainer.proximal=current", "trainer.value_recompute=off"],
        "so it needs trainer.value_recompute=pass; got off",
    ),
    "_minibatches_fit_the_groups": (
        ["generator.prompts_per_step=4", "trainer.minibatches=5"],
        "trainer.minibatches=5 is more than a step's groups (generator.prompts_per_step=4)",
    ),
    "_vcpo_baseline_weighs_as_tis_seq": (
        ["trainer.advantage=vcpo_baseline"],
        "it needs trainer.loss=tis_seq and trainer.proximal=behaviour; got trainer.loss=aipo",
    ),
    "_gae_takes_the_kl_in_the_loss": (
        ["trainer.advantage=gae", "trainer.kl_coef=0.1", "trainer.kl_in=reward"],
        "trainer.advantage=gae with trainer.kl_in=reward is not supported",
    ),
    "_several_envs_need_async": (
        [*EMBODIED, "mode=sync", "rollout.envs_per_worker=2"],
        "rollout.envs_per_worker=2 needs mode=async",
    ),
    "_int8_generator_needs_int8_storage": (
        ["generator.precision=int8", "sync.precision=bf16"],
        "sync.precision=bf16 stores them otherwise",
    ),
    "_in_place_sync_needs_one_rank": (
        ["trainer.ranks=2", "sync.transport=dist", "sync.in_place=true"],
        "sync.in_place=true with trainer.ranks=2",
    ),
}


def test_every_rule_has_a_refusal_test():
    rules = dict.fromkeys(rule for workload in RULES.values() for rule in workload)
    assert sorted(rule.__name__ for rule in rules) == sorted(REFUSALS)
    assert all(rule.__doc__ for rule in rules)


@pytest.mark.parametrize("rule", list(REFUSALS))
def test_each_rule_refuses_its_combination_in_one_line(rule):
    overrides, expected = REFUSALS[rule]
    assert expected in refusal(None, overrides)


def test_the_rules_accept_the_nearest_valid_combinations():
    ok = [
        [*EMBODIED, "env.image_size=48", "vla.patch_size=6"],  # 48 = 8 patches, no world model
        [*EMBODIED, "env.image_size=24", "world_model.levels=2", "imagination.episodes_per_real=1"],
        [
            *EMBODIED,
            "replay.wait_at=8",
            "imagination.episodes_per_real=1",
            "imagination.real_ratio=0.5",
        ],
        [*EMBODIED, "imagination.episodes_per_real=1", "imagination.buffer_steps=512"],
        [*EMBODIED, "inference.min_lag=2"],
        ["generator.min_lag=2", "channels.capacity=2"],
        ["trainer.advantage=gae", "trainer.kl_coef=0.1", "trainer.kl_in=loss"],
        ["generator.prompts_per_step=4", "trainer.minibatches=4"],
        # VCPO's recipe
        ["trainer.advantage=vcpo_baseline", "trainer.loss=tis_seq", "trainer.seq_is_cap=8"]
        + ["trainer.ess_lr=true"],
    ]
    for overrides in ok:
        assert isinstance(load_config(None, overrides), Config), overrides


SHIPPED = sorted((REPO / "configs").glob("*.yaml"))
PRESETS = sorted((REPO / "configs" / "presets").glob("*.yaml"))


def set_keys(tree: dict, prefix: str = "") -> list[str]:
    """The dotted keys a YAML mapping sets."""
    keys = []
    for key, value in tree.items():
        keys += set_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [prefix + key]
    return keys


@pytest.mark.parametrize(
    ("path", "preset"),
    [(p, None) for p in SHIPPED] + [(BABYAI, p) for p in PRESETS],
    ids=[p.name for p in SHIPPED] + [f"babyai+{p.name}" for p in PRESETS],
)
def test_every_option_a_shipped_config_sets_belongs_to_something_present(path, preset):
    from relayrl.algorithms.losses import LOSS_OPTIONS

    cfg = load_config(path, [], [preset] if preset else [])
    tree = yaml.safe_load((preset or path).read_text())
    loss_options = {f for options in LOSS_OPTIONS.values() for f in options.values()}
    for key in set_keys(tree):
        section, _, name = key.partition(".")
        assert isinstance(cfg, CONFIGS[cfg.workload]), key
        assert getattr(cfg, section) is not None, key  # the workload's, and a feature that is on
        if section == "trainer" and name in loss_options:
            assert name in LOSS_OPTIONS[cfg.trainer.loss].values(), key


def test_a_presets_loss_options_apply_only_with_its_loss():
    acce = REPO / "configs" / "presets" / "acce.yaml"
    cfg = load_config(BABYAI, [], [acce])
    assert cfg.trainer.loss == "gipo" and cfg.trainer.gipo_sigma == 0.2
    cfg = load_config(BABYAI, ["trainer.loss=ppo_clip"], [acce])  # the loss the override chose
    assert cfg.trainer.loss == "ppo_clip" and cfg.trainer.value_recompute == "fused"
    assert "gipo_sigma" not in cfg.trainer.model_fields_set
    message = refusal(BABYAI, ["trainer.loss=ppo_clip", "trainer.gipo_sigma=0.3"], presets=[acce])
    assert message.startswith("trainer.gipo_sigma = 0.3: an option of loss gipo")


@pytest.mark.parametrize(
    ("overrides", "setting"),
    [
        ([*EMBODIED, "trainer.proximal_weight_cap=1.5"], "trainer.proximal=current"),
        (["trainer.kl_estimator=k1"], "trainer.kl_coef > 0"),
        (["log.wandb_mode=online"], "log.wandb_project"),
        (
            ["trainer.lr_schedule=constant", "trainer.lr_final_ratio=0.5"],
            "trainer.lr_schedule=cosine",
        ),
        (["task.prompt_field=question"], "task.name=dataset"),
        (["rewarder.workers=4"], "rewarder.scorer=math or a module:function rule"),
        ([*EMBODIED, "env.latency_sigma=0.5"], "env.latency=lognormal"),
        ([*EMBODIED, "env.latency_mean_ms=5"], "env.latency other than none"),
        ([*EMBODIED, "env.suite=libero_goal"], "env.name=libero"),
        (
            [*EMBODIED, "imagination.episodes_per_real=1", "world_model.backend=deterministic"]
            + ["world_model.sigma_max=3"],
            "world_model.backend=diffusion",
        ),
        (
            [*EMBODIED, "imagination.episodes_per_real=1", "world_model.failure_head=false"]
            + ["world_model.failure_threshold=0.5"],
            "world_model.failure_head=true",
        ),
    ],
)
def test_an_option_read_only_under_a_setting_is_refused_without_it(overrides, setting):
    key = overrides[-1].split("=")[0]
    assert f"{key} = " in (message := refusal(None, overrides))
    assert message.endswith(f"read only with {setting}; remove it or set {setting}")


def test_a_saved_config_leaves_out_options_whose_setting_is_off(tmp_path):
    cfg = load_config(
        None,
        [*EMBODIED, "imagination.episodes_per_real=1"]
        + ["world_model.backend=deterministic", "trainer.proximal=behaviour"],
    )
    saved = tmp_path / "config.yaml"
    save_config(cfg, saved)
    written = yaml.safe_load(saved.read_text())
    assert "sigma_max" not in written["world_model"] and "channels" in written["world_model"]
    assert "proximal_weight_cap" not in written["trainer"] and "wandb_mode" not in written["log"]
    assert load_config(saved) == cfg
    with_cap = load_config(None, [*EMBODIED, "trainer.proximal=current"])
    save_config(with_cap, saved)
    assert yaml.safe_load(saved.read_text())["trainer"]["proximal_weight_cap"] == 2.0
