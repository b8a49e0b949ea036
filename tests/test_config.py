"""Config loading: every shipped YAML validates, overrides are typed, errors are one line."""

from pathlib import Path

import pytest
import yaml

from relayrl.algorithms import ADVANTAGES, LOSSES
from relayrl.config import (
    MOVED,
    ConfigError,
    EmbodiedConfig,
    LLMConfig,
    LLMTrainerConfig,
    load_config,
    save_config,
)

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted((REPO / "configs").glob("*.yaml"))
ARITH = REPO / "configs" / "arith.yaml"


def leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    """{"a.b": value} for every non-mapping value of a nested mapping."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(leaves(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_error(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert message and "\n" not in message, message
    return message


def test_configs_are_shipped():
    assert ARITH in SHIPPED


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_config_validates_and_keeps_every_value(path):
    cfg = load_config(path)

    written = leaves(yaml.safe_load(path.read_text()) or {})
    resolved = leaves(cfg.model_dump())
    for key, value in written.items():
        assert resolved[key] == value, key


def test_arith_config_is_async_aipo():
    cfg = load_config(ARITH)

    assert cfg.mode == "async"
    assert cfg.trainer.loss == "aipo"
    assert cfg.trainer.advantage == "grpo"
    assert cfg.max_staleness == 1
    assert cfg.warm_start.lr == pytest.approx(1e-3)


def test_no_file_gives_the_defaults():
    assert load_config(None) == LLMConfig()


def test_empty_file_gives_the_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")

    assert load_config(path) == LLMConfig()


@pytest.mark.parametrize(
    ("override", "field", "expected"),
    [
        ("steps=5", "steps", 5),
        ("mode=sync", "mode", "sync"),
        ("trainer.lr=1e-4", "trainer.lr", 1e-4),
        ("trainer.aipo_rho=3", "trainer.aipo_rho", 3.0),
        ("trainer.grad_clip=2", "trainer.grad_clip", 2.0),
        ("log.tensorboard=false", "log.tensorboard", False),
        ("task.reverse_answer=False", "task.reverse_answer", False),
        ("run.name=smoke", "run.name", "smoke"),
        ("run.name=2024", "run.name", "2024"),
        ("ray.address=10.0.0.1:6379", "ray.address", "10.0.0.1:6379"),
        ("ray.address=null", "ray.address", None),
        ("trainer.loss=ppo_clip", "trainer.loss", "ppo_clip"),
    ],
)
def test_override_sets_a_typed_value(override, field, expected):
    cfg = load_config(ARITH, [override])

    section, _, name = field.rpartition(".")
    value = getattr(getattr(cfg, section) if section else cfg, name)
    assert value == expected
    assert type(value) is type(expected)


def test_null_override_clears_a_value_set_earlier(tmp_path):
    cfg = load_config(ARITH, ["model.path=" + str(tmp_path), "model.path=null"])

    assert cfg.model.path is None


def test_later_overrides_win_over_earlier_ones_and_the_file():
    cfg = load_config(ARITH, ("steps=5", "trainer.loss=ppo_clip", "steps=7"))

    assert cfg.steps == 7
    assert cfg.trainer.loss == "ppo_clip"
    assert cfg.warm_start.lr == 1e-3  # untouched file value survives


def test_model_path_to_an_existing_directory_is_accepted(tmp_path):
    assert load_config(None, [f"model.path={tmp_path}"]).model.path == str(tmp_path)


def test_every_loss_and_advantage_name_is_accepted():
    for loss in LOSSES:
        assert load_config(None, [f"trainer.loss={loss}"]).trainer.loss == loss
    for advantage in ADVANTAGES:
        cfg = load_config(None, [f"trainer.advantage={advantage}"])
        assert cfg.trainer.advantage == advantage


def test_the_built_in_names_the_descriptions_list_are_the_registries():
    from relayrl.config import BUILTIN_ADVANTAGES, BUILTIN_LOSSES

    assert tuple(sorted(LOSSES)) == BUILTIN_LOSSES
    assert tuple(sorted(ADVANTAGES)) == BUILTIN_ADVANTAGES


def test_unknown_top_level_key_lists_the_allowed_keys():
    message = config_error(ARITH, ["stepz=5"])

    assert message.startswith("stepz: unknown key")
    for key in LLMConfig.model_fields:
        assert key in message


def test_unknown_top_level_key_in_the_file(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("mode: sync\nbogus: 1\n")

    assert config_error(path).startswith("bogus: unknown key (allowed here: mode, steps")


def test_unknown_nested_key_lists_the_keys_of_its_section():
    message = config_error(ARITH, ["trainer.los=ppo_clip"])

    assert message.startswith("trainer.los: unknown key")
    for key in LLMTrainerConfig.model_fields:
        assert key in message
    assert "generator" not in message


def test_wrong_type_names_field_value_and_type():
    message = config_error(ARITH, ["steps=abc"])

    assert message.startswith("steps = 'abc': ")
    assert "valid integer" in message


def test_fractional_int_is_rejected():
    assert config_error(None, ["steps=1.5"]).startswith("steps = 1.5: ")


def test_section_given_a_scalar_is_rejected():
    assert config_error(None, ["trainer=3"]).startswith("trainer = 3: ")


def test_an_override_that_is_not_valid_yaml_says_how_to_quote_it():
    dataset = ["task.name=dataset", "task.data=gsm8k"]
    with pytest.raises(ConfigError, match=r"task.template = '\{q\} A:': not a valid YAML value"):
        load_config(None, [*dataset, "task.template={q} A:"])
    assert load_config(None, [*dataset, "task.template='{q} A:'"]).task.template == "{q} A:"


def test_negative_max_staleness_says_what_is_allowed():
    message = config_error(ARITH, ["max_staleness=-1"])

    assert message.startswith("max_staleness = -1: ")
    assert "greater than or equal to 0" in message


def test_negative_max_staleness_in_the_file(tmp_path):
    path = tmp_path / "stale.yaml"
    path.write_text("max_staleness: -3\n")

    assert config_error(path).startswith("max_staleness = -3: ")


@pytest.mark.parametrize("workload", ["robot", "[llm]", "null"])
def test_an_unknown_workload_lists_the_workloads(workload):
    message = config_error(None, [f"workload={workload}"])
    assert message.startswith("workload = ")
    assert message.endswith(": Input should be 'llm' or 'embodied'")


def test_unknown_mode_lists_the_modes():
    message = config_error(None, ["mode=fast"])

    assert message.startswith("mode = 'fast': ")
    assert "'sync' or 'async'" in message


def test_unknown_loss_lists_the_losses():
    message = config_error(ARITH, ["trainer.loss=grpo_magic"])

    assert message.startswith("trainer.loss = 'grpo_magic': unknown loss")
    assert "aipo, aipo_clamp, ess_aipo, geo_mask, gipo, m2po, m2po_release, mis_seq" in message
    for loss in LOSSES:
        assert loss in message


def test_unknown_advantage_lists_the_advantages():
    message = config_error(ARITH, ["trainer.advantage=ppo"])

    assert message.startswith("trainer.advantage = 'ppo': unknown advantage")
    for advantage in [*ADVANTAGES, "gae"]:
        assert advantage in message


def test_missing_config_file_is_named(tmp_path):
    path = tmp_path / "nope.yaml"

    assert config_error(path) == f"config file '{path}' not found"


def test_directory_as_config_file_is_not_found(tmp_path):
    assert "not found" in config_error(tmp_path)


def test_yaml_syntax_error_is_one_line_with_its_position(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("mode: sync\ntrainer: [loss,\n")

    message = config_error(path)

    assert message.startswith(f"config file '{path}' is not readable YAML: ")
    assert "line 3" in message


def test_non_utf8_file_is_a_config_error(tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe\x00")

    assert "is not readable YAML" in config_error(path)


def test_file_must_hold_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- mode\n- sync\n")

    assert config_error(path).endswith("must hold a mapping, got list")


def test_model_path_to_a_missing_directory_is_named(tmp_path):
    missing = tmp_path / "no-checkpoint"

    message = config_error(ARITH, [f"model.path={missing}"])

    assert message == f"model.path = '{missing}': directory does not exist"


def test_unknown_builtin_tokenizer_lists_the_builtins():
    message = config_error(None, ["model.tokenizer=builtin:bpe"])

    assert message.startswith("model.tokenizer = 'builtin:bpe': ")
    assert "allowed: builtin:char" in message


@pytest.mark.parametrize("override", ["steps", "=5", "trainer.loss"])
def test_override_without_key_and_equals_is_rejected(override):
    message = config_error(ARITH, [override])

    assert message == f"override '{override}' must look like a.b=value"


def test_unresolvable_interpolation_is_one_line():
    assert "nope" in config_error(None, ["run.name=${nope}"])


def test_several_problems_report_the_first_and_count_the_rest():
    message = config_error(None, ["steps=0", "max_staleness=-1"])

    assert message.startswith("steps = 0: ")
    assert message.endswith("(and 1 more)")


def test_config_error_hides_the_library_exception():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["steps=abc"])

    assert info.value.__cause__ is None
    assert info.value.__suppress_context__


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_save_config_round_trips_shipped_configs(path, tmp_path):
    cfg = load_config(path)
    saved = tmp_path / "config.yaml"

    save_config(cfg, saved)

    assert load_config(saved) == cfg


def test_save_config_round_trips_overridden_values(tmp_path):
    cfg = load_config(
        ARITH,
        [
            "mode=sync",
            "trainer.loss=ppo_clip",
            "trainer.lr=1e-7",
            "ray.address=auto",
            f"model.path={tmp_path}",
            "run.name=2024",
            "log.progress=false",
        ],
    )
    saved = tmp_path / "config.yaml"

    save_config(cfg, saved)

    assert load_config(saved) == cfg
    written = yaml.safe_load(saved.read_text())
    off = {"reward_model", "reward_models", "reference", "critic"}  # none placed or declared
    assert list(written) == [k for k in LLMConfig.model_fields if k not in off]
    assert not {"env", "rollout", "inference", "replay", "vla"} & set(written)
    assert "gamma" not in written["trainer"] and written["trainer"]["lr"] == 1e-7
    assert "ppo_clip_eps" in written["trainer"] and "aipo_rho" not in written["trainer"]
    assert written["run"]["name"] == "2024"


def test_in_place_sync_needs_the_dist_transport():
    message = config_error(None, ["sync.in_place=true"])

    assert message.startswith("sync = ")
    assert "sync.in_place=true needs sync.transport=dist, got 'auto'" in message
    assert load_config(None, ["sync.in_place=true", "sync.transport=dist"]).sync.in_place


def test_generator_precision_fp8_is_refused_with_what_is_allowed():
    message = config_error(None, ["generator.precision=fp8"])

    assert message.startswith("generator.precision = 'fp8': fp8 matmuls need a CUDA GPU")
    assert "allowed: fp32, int8" in message


def test_unknown_generator_precision_lists_the_precisions():
    message = config_error(None, ["generator.precision=int4"])

    assert message == "generator.precision = 'int4': Input should be 'fp32' or 'int8'"


@pytest.mark.parametrize("storage", ["fp32", "bf16", "fp16", "fp8"])
def test_an_int8_generator_needs_int8_storage_at_the_receiver(storage):
    message = config_error(None, ["generator.precision=int8", f"sync.precision={storage}"])

    assert message.startswith("generator.precision=int8 computes with the int8 weights")
    assert f"sync.precision={storage} stores them otherwise" in message


@pytest.mark.parametrize("storage", [None, "int8"])
def test_an_int8_generator_takes_null_or_int8_storage(storage):
    overrides = ["generator.precision=int8", f"sync.precision={storage or 'null'}"]

    cfg = load_config(None, overrides)

    assert cfg.generator.precision == "int8" and cfg.sync.precision == storage
    assert load_config(None, []).generator.precision == "fp32"


@pytest.mark.parametrize(
    ("workload", "key"),
    [
        ("llm", "env.name=babyai"),
        ("llm", "trainer.epochs=3"),
        ("embodied", "generator.group_size=4"),
        ("embodied", "trainer.advantage=dr_grpo"),
        ("embodied", "sync.precision=bf16"),
        ("embodied", "generator.precision=int8"),
    ],
)
def test_a_knob_the_workload_does_not_read_is_refused(workload, key):
    message = config_error(None, [f"workload={workload}", key])
    other = "embodied" if workload == "llm" else "llm"
    field = key.split("=")[0]
    named = field.split(".")[0] if field.split(".")[0] in ("env", "generator") else field
    assert message.startswith(f"{named}: ")
    assert f"does not apply to workload='{workload}'" in message
    assert f"only workload='{other}' reads it" in message


def test_a_saved_embodied_config_leaves_out_the_llm_knobs_and_loads_again(tmp_path):
    cfg = load_config(REPO / "configs" / "babyai.yaml")
    saved = tmp_path / "config.yaml"
    save_config(cfg, saved)
    written = yaml.safe_load(saved.read_text())
    assert "generator" not in written and "advantage" not in written["trainer"]
    assert "precision" not in written["sync"]
    assert load_config(saved) == cfg


def test_in_place_sync_is_refused_for_a_sharded_trainer():
    message = config_error(None, ["trainer.ranks=2", "sync.transport=dist", "sync.in_place=true"])
    assert "sync.in_place=true with trainer.ranks=2" in message


def test_a_forced_lag_beyond_max_staleness_is_refused_naming_both_fields():
    message = config_error(None, ["generator.min_lag=3", "max_staleness=2"])
    assert "max_staleness=2 must be >= generator.min_lag=3" in message
    cfg = load_config(None, ["generator.min_lag=3", "max_staleness=3", "channels.capacity=3"])
    assert cfg.generator.min_lag == cfg.max_staleness == 3


def test_an_async_forced_lag_needs_channels_that_hold_its_batches():
    lag = ["generator.min_lag=16", "max_staleness=64"]
    message = config_error(None, [*lag, "channels.capacity=15"])
    assert "channels.capacity=15 must be >= generator.min_lag=16 in async mode" in message
    assert load_config(None, [*lag, "channels.capacity=16"]).generator.min_lag == 16
    assert load_config(None, [*lag, "mode=sync"]).channels.capacity == 1  # sync has no channels


def test_gae_with_the_kl_in_the_reward_is_refused_with_the_way_out():
    message = config_error(
        ARITH, ["trainer.advantage=gae", "trainer.kl_coef=0.1", "trainer.kl_in=reward"]
    )
    assert "trainer.advantage=gae with trainer.kl_in=reward" in message
    assert "use trainer.kl_in=loss" in message


def test_more_minibatches_than_a_steps_groups_is_refused_giving_both_counts():
    message = config_error(None, ["generator.prompts_per_step=4", "trainer.minibatches=5"])
    assert "trainer.minibatches=5 is more than a step's groups" in message
    assert "generator.prompts_per_step=4" in message
    cfg = load_config(None, ["generator.prompts_per_step=4", "trainer.minibatches=4"])
    assert cfg.trainer.minibatches == 4


PRESETS = sorted((REPO / "configs" / "presets").glob("*.yaml"))


@pytest.mark.parametrize("path", PRESETS, ids=[p.name for p in PRESETS])
def test_each_preset_merges_over_the_babyai_config_and_keeps_every_value(path):
    cfg = load_config(REPO / "configs" / "babyai.yaml", [], [path])
    written = leaves(yaml.safe_load(path.read_text()))
    resolved = leaves(cfg.model_dump())
    for key, value in written.items():
        assert resolved[key] == value, key
    assert cfg.env.name == "babyai"  # the config's own values stay where the preset is silent


def test_a_preset_by_name_is_found_beside_the_config_and_overrides_come_last():
    from relayrl.config import preset_path

    babyai = REPO / "configs" / "babyai.yaml"
    found = preset_path("acce", babyai)
    assert found == REPO / "configs" / "presets" / "acce.yaml"
    cfg = load_config(babyai, ["trainer.gipo_sigma=0.5"], [found])
    assert cfg.trainer.gipo_sigma == 0.5 and cfg.trainer.value_recompute == "fused"
    with pytest.raises(ConfigError, match="preset '.*nope.yaml' not found"):
        load_config(babyai, [], [preset_path("nope", babyai)])


def test_acce_options_reach_the_task_choice_and_the_vla_config():
    from relayrl.models.vla import vla_config
    from relayrl.workloads.task_choice import TaskChoice

    overrides = ["rollout.dwr_formula=acce", "rollout.dwr_alpha=0.5", "vla.value_head=acce"]
    cfg = load_config(REPO / "configs" / "babyai.yaml", [*overrides, "rollout.curriculum=false"])
    choice = TaskChoice(cfg, ("a", "b"))
    choice.record("a", success=False)
    # acce: (1 + 0.5) against the unseen task's 0.5; smoothed would give 1.5/2 against 0.5/1
    assert choice.weights() == pytest.approx([3 / 4, 1 / 4])
    sizes = vla_config(cfg.vla, image_size=cfg.env.image_size, views=1, dims=1, vocab=3)
    assert sizes.value_head == "acce"
    assert load_config(REPO / "configs" / "babyai.yaml").vla.value_head == "action_aware_attention"


def test_several_envs_per_worker_need_the_async_loop():
    with pytest.raises(ConfigError, match="rollout.envs_per_worker=2 needs mode=async"):
        load_config(None, ["workload=embodied", "mode=sync", "rollout.envs_per_worker=2"])
    cfg = load_config(None, ["workload=embodied", "mode=async", "rollout.envs_per_worker=2"])
    assert cfg.rollout.envs_per_worker == 2


def test_replay_wait_at_above_the_capacity_is_refused():
    with pytest.raises(ConfigError, match=r"replay.wait_at=4097 must be <= capacity_steps=4096"):
        load_config(None, ["workload=embodied", "replay.wait_at=4097"])
    assert load_config(None, ["workload=embodied", "replay.wait_at=1"]).replay.wait_at == 1


@pytest.mark.parametrize(
    ("workload", "old", "new"),
    [
        ("embodied", "inference.early_drain=false", "experiment.early_drain"),
        ("embodied", "inference.transport=ray", "experiment.inference_transport"),
        ("llm", "trainer.skip_zero_signal=false", "experiment.skip_zero_signal"),
        ("llm", "generator.greedy=true", "experiment.generator_greedy"),
    ],
)
def test_a_study_switch_that_moved_is_refused_naming_its_new_key(workload, old, new):
    key, value = old.split("=")
    assert config_error(None, [f"workload={workload}", old]) == f"{key}: moved to {new}"
    cfg = load_config(None, [f"workload={workload}", f"{new}={value}"])
    default = getattr(load_config(None, [f"workload={workload}"]).experiment, new.split(".")[1])
    assert getattr(cfg.experiment, new.split(".")[1]) == yaml.safe_load(value) != default


def test_every_moved_key_names_an_option_of_an_experiment_section():
    fields = {*LLMConfig.model_fields["experiment"].annotation.model_fields}
    fields |= {*EmbodiedConfig.model_fields["experiment"].annotation.model_fields}
    assert {new.removeprefix("experiment.") for new in MOVED.values()} <= fields
    assert all(new.startswith("experiment.") for new in MOVED.values())


def test_a_moved_key_given_to_the_other_workload_names_the_workload_that_reads_it():
    message = config_error(None, ["workload=embodied", "trainer.skip_zero_signal=false"])
    assert message == (
        "trainer.skip_zero_signal: moved to experiment.skip_zero_signal, which only "
        "workload='llm' reads"
    )
    # where the other workload has no such section, that section is refused
    message = config_error(None, ["workload=embodied", "generator.greedy=true"])
    assert message.startswith("generator: does not apply to workload='embodied'")
    message = config_error(None, ["inference.transport=ray"])
    assert message.startswith("inference: does not apply to workload='llm'")


def test_each_workloads_experiment_section_holds_only_its_own_switches():
    message = config_error(None, ["experiment.early_drain=false"])
    assert message.startswith("experiment.early_drain: does not apply to workload='llm'")
    message = config_error(None, ["workload=embodied", "experiment.generator_greedy=true"])
    assert message.startswith("experiment.generator_greedy: does not apply to workload='embodied'")
    assert isinstance(load_config(None, ["workload=embodied"]), EmbodiedConfig)
