"""Several reward-model stages declared in YAML (``reward_models``): the config's checks, the
chain they make, how their scores enter the reward, and a run that trains on both."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from conftest import SMALL_LLM, TINY, tiny_config, tiny_reward_model

from relayrl import job
from relayrl.config import ConfigError, load_config, save_config
from relayrl.executors.generator import Generator
from relayrl.executors.reward_model import RewardModel
from relayrl.executors.stages import config_stages


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny classifiers with different weights, so their scores differ."""
    root = tmp_path_factory.mktemp("rms")
    return tiny_reward_model(root / "a", seed=1), tiny_reward_model(root / "b", seed=2)


def _two(a, b, weights=(1.0, 1.0)) -> str:
    """The override declaring rm_a and rm_b with ``weights``."""
    return (
        f"reward_models=[{{name: rm_a, path: '{a}', weight: {weights[0]}}}, "
        f"{{name: rm_b, path: '{b}', weight: {weights[1]}, replicas: 2}}]"
    )


def test_each_declared_reward_model_is_a_stage_after_the_rewarder_in_order(models, tmp_path):
    a, b = models
    cfg = tiny_config(_two(a, b), f"reward_model.path={a}")
    chain = config_stages(cfg)
    assert [s.name for s in chain] == ["rewarder", "reward_model", "rm_a", "rm_b"]
    assert [s.cls for s in chain[1:]] == [RewardModel] * 3
    assert [s.args for s in chain[2:]] == [("rm_a",), ("rm_b",)]
    assert [s.replicas for s in chain[2:]] == [1, 2]
    save_config(cfg, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert [rm["name"] for rm in saved["reward_models"]] == ["rm_a", "rm_b"]
    assert load_config(tmp_path / "config.yaml").reward_models == cfg.reward_models
    save_config(tiny_config(), tmp_path / "none.yaml")  # none declared: nothing written
    assert "reward_models" not in yaml.safe_load((tmp_path / "none.yaml").read_text())


@pytest.mark.parametrize(
    ("entries", "error"),
    [
        (
            "[{name: rm_a, path: P}, {name: rm_a, path: P}]",
            "reward_models.1.name = 'rm_a': reward_models.0 has this name; each reward model "
            "needs its own",
        ),
        ("[{name: critic, path: P}]", "reward_models.0.name = 'critic': a built-in role's name"),
        ("[{name: reward_model, path: P}]", "reward_models.0.name = 'reward_model': a built-in"),
        ("[{name: rm_a, weight: 2}]", "reward_models.0.path: required, not given"),
        ("[{path: P}]", "reward_models.0.name: required, not given"),
        ("[{name: rm_a, path: P, wieght: 2}]", "reward_models.0.wieght: unknown key"),
        ("[{name: Rm, path: P}]", "reward_models.0.name = 'Rm': use lowercase letters"),
    ],
)
def test_a_bad_reward_models_entry_is_refused_in_one_line_naming_it(entries, error, tmp_path):
    with pytest.raises(ConfigError) as refused:
        load_config(None, [*TINY, f"reward_models={entries.replace('P', str(tmp_path))}"])
    assert str(refused.value).startswith(error) and "\n" not in str(refused.value)


def test_a_missing_model_directory_and_an_embodied_run_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="reward_models.0.path = '.*nowhere': directory does not"):
        load_config(None, [*TINY, f"reward_models=[{{name: a, path: {tmp_path / 'nowhere'}}}]"])
    with pytest.raises(ConfigError, match="^reward_models: "):
        load_config(None, ["workload=embodied", f"reward_models=[{{name: a, path: {tmp_path}}}]"])


def test_each_reward_model_adds_its_weight_times_its_score(models):
    """rule_weight 1 (the default): reward = rule + 2 * score_a - 3 * score_b."""
    a, b = models
    cfg = tiny_config(_two(a, b, weights=(2.0, -3.0)))
    batch = Generator(cfg).complete([[2, 4, 13, 5, 16], [2, 6, 13, 7, 16]], ["9", "13"], k=2)
    batch.rewards = np.array([1.0, 0.0, 0.0, 1.0], dtype=np.float32)
    rm_a, rm_b = RewardModel(cfg, "rm_a"), RewardModel(cfg, "rm_b")
    _, after_a = rm_a.score(batch)
    summary, after_b = rm_b.score(after_a)
    score_a, score_b = rm_a.scores(*rm_a._texts(batch)), rm_b.scores(*rm_b._texts(batch))
    assert not np.allclose(score_a, score_b)  # two models, two judgements
    assert np.allclose(after_b.rewards, batch.rewards + 2 * score_a - 3 * score_b, atol=1e-5)
    assert after_b.stage_metrics == {
        "rm_a/score_mean": pytest.approx(score_a.mean()),
        "rm_b/score_mean": pytest.approx(score_b.mean()),
    }
    assert rm_a.stats().scored == rm_b.stats().scored == summary["samples"] == 4
    assert (rm_a.tracer.executor, rm_b.tracer.executor) == ("rm_a", "rm_b")
    assert [s.name for s in rm_a.tracer.spans] == ["score"]
    with pytest.raises(ValueError, match="no reward_models entry has name='rm_c'"):
        RewardModel(cfg, "rm_c")


def test_a_yaml_run_with_two_reward_models_trains_on_both(ray_session, models, tmp_path):
    """Sync, so every generated sample is scored and trained in its step: each stage's books
    count every sample, and each step's trained reward is its rule reward plus 2 * rm_a's mean
    score minus 3 * rm_b's."""
    a, b = models
    config = tmp_path / "two_reward_models.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "mode": "sync",
                "steps": 3,
                "reward_models": [
                    {"name": "rm_a", "path": str(a), "weight": 2.0},
                    {"name": "rm_b", "path": str(b), "weight": -3.0, "replicas": 2},
                ],
            }
        )
    )
    cfg = load_config(config, [*TINY, *SMALL_LLM[1:]])
    summary = job.train(cfg, tmp_path / "run")
    assert summary["status"] == "finished" and summary["samples"]["accounted"]
    generated = summary["samples"]["generated"]
    assert generated == 3 * 4 * 4  # steps x prompts x group size
    stages = summary["stages"]
    assert stages["rm_a"]["scored"] == stages["rm_b"]["scored"] == generated
    assert stages["rm_a"]["errors"] == stages["rm_b"]["errors"] == 0
    assert stages["rewarder"]["scored"] >= generated  # and the evaluations
    topology = json.dumps(json.loads((tmp_path / "run" / "summary.json").read_text())["topology"])
    assert "rm_a" in topology and "rm_b_1" in topology
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    steps = [r for r in records if "rollout/trained_reward_mean" in r]
    assert len(steps) == 3
    for r in steps:
        mixed = r["rollout/reward_mean"] + 2 * r["rm_a/score_mean"] - 3 * r["rm_b/score_mean"]
        assert r["rollout/trained_reward_mean"] == pytest.approx(mixed, abs=1e-4)
        # each model's term is visible, and the two differ: leaving one out breaks the sum
        assert min(abs(r["rm_a/score_mean"]), abs(r["rm_b/score_mean"])) > 0.01
        assert r["rm_a/score_mean"] != pytest.approx(r["rm_b/score_mean"], abs=1e-3)
