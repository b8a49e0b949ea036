"""End to end through Ray: a few real steps in each mode, with accounting and lag checks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import SMALL_LLM as SMALL
from conftest import left_shm_files, shm_files, tiny_config
from safetensors.torch import load_file

from relayrl.config import Config
from relayrl.executors.trainer import Trainer
from relayrl.job import train
from relayrl.launch import pick_transport
from relayrl.roles import RoleTableError


def _run(tmp_path, *overrides):
    cfg = tiny_config(*SMALL, *overrides)
    summary = train(cfg, tmp_path / "run")
    return cfg, summary


def test_async_run_changes_parameters_and_records_bounded_lags(ray_session, tmp_path):
    before = shm_files()
    cfg, summary = _run(
        tmp_path, "mode=async", "max_staleness=1", "log.eval_every=3", "log.report=true"
    )
    assert left_shm_files(before) == [], "the run left its shm weight-sync files behind"
    assert summary["steps"] == 6 and summary["skipped_nonfinite"] == 0
    assert summary["eval"]["end"]["version"] == summary["updates"] >= 1
    assert summary["eval"]["end"]["n"] == 20
    samples = summary["samples"]
    assert samples["accounted"]
    assert (
        samples["generated"] == samples["trained"] + samples["dropped_stale"] + samples["in_flight"]
    )
    hist = {int(k): v for k, v in summary["staleness"]["hist"].items()}
    assert sum(hist.values()) == samples["trained"]
    assert max(hist) <= 1 and summary["staleness"]["max"] <= 1
    assert set(summary["perf"]["busy"]) == {"generator", "rewarder", "trainer"}
    sync = summary["sync"]
    assert sync["transport"] == "shm" and sync["lost"] == {}
    assert sync["publishes"] >= summary["updates"] and 0 < sync["mean_s"] <= sync["max_s"]

    warm = Trainer(cfg)  # the same seeded warm start the run did, before any RL step
    warm.warm_start(40)
    before_rl = warm.model.state_dict()
    trained = load_file(tmp_path / "run" / "checkpoint" / "model.safetensors")
    moved = max((t - before_rl[name]).abs().max().item() for name, t in trained.items())
    assert moved > 1e-3, "RL steps did not change the parameters"

    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["samples"] == samples
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 3, 6]
    grad_norms = [r.get("loss/grad_norm", 0.0) for r in records]
    assert max(grad_norms) > 0
    assert (tmp_path / "run" / "learning_curve.png").stat().st_size > 0
    _check_trace_agrees_with_summary(tmp_path / "run", summary)
    assert (tmp_path / "run" / "report.md").is_file() and summary["artifacts"]["report"]


def _check_trace_agrees_with_summary(run_dir, summary):
    """Busy fractions recomputed from trace.json alone match summary.json within 2 points."""
    trace = json.loads((run_dir / "trace.json").read_text())
    start, end = trace["otherData"]["rl_window_us"]
    names = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    busy = dict.fromkeys(names.values(), 0.0)
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["cat"] == "work":
            overlap = min(e["ts"] + e["dur"], end) - max(e["ts"], start)
            busy[names[e["pid"]]] += max(0.0, overlap) / (end - start)
    for name, fraction in summary["perf"]["busy"].items():
        assert abs(busy[name] - fraction) < 0.02, (name, busy[name], fraction)
    assert summary["perf"]["busy"]["trainer"] > 0
    assert (run_dir / "timeline.png").stat().st_size > 0


@pytest.fixture(scope="module")
def sync_run(ray_session, tmp_path_factory) -> tuple[Config, dict]:
    """One sync run that two tests below share: two replicas, weights sent over dist in bf16."""
    cfg = tiny_config(
        *SMALL,
        *("mode=sync", "sync.transport=dist", "sync.precision=bf16", "generator.replicas=2"),
    )
    return cfg, train(cfg, tmp_path_factory.mktemp("sync") / "run")


def test_sync_run_is_strictly_on_policy(sync_run):
    _, summary = sync_run
    assert summary["steps"] == 6
    assert summary["sync"]["transport"] == "dist" and summary["sync"]["publishes"] >= 7
    assert summary["staleness"]["hist"] == {"0": summary["samples"]["trained"]}
    assert summary["samples"]["in_flight"] == 0 and summary["samples"]["accounted"]


def test_an_int8_generator_run_reports_the_precision_gap_as_its_pi_mu_ratio(ray_session, tmp_path):
    # An unreachable target: the warm start probes at steps 20 and 40, then stops at max_steps.
    probing = ["warm_start.target_accuracy=1.0", "warm_start.check_every=20"]
    _, summary = _run(tmp_path, "mode=sync", "generator.precision=int8", *probing)
    assert summary["warm_start"]["warm_start/steps"] == 40
    # The trainer's own fp32 policy answers the probe, not the int8 generator's copy.
    trace = json.loads((tmp_path / "run" / "trace.json").read_text())
    meta = [e for e in trace["traceEvents"] if e["name"] == "process_name"]
    names = {e["pid"]: e["args"]["name"] for e in meta}
    spans = [(names[e["pid"]], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X"]
    assert spans.count(("trainer", "probe")) == 2
    assert not [span for span in spans if span[1] == "evaluate:probe"]
    assert summary["staleness"]["hist"] == {"0": summary["samples"]["trained"]}
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    means = [r["loss/ratio_mean"] for r in records if "loss/ratio_mean" in r]
    maxima = [r["loss/ratio_max"] for r in records if "loss/ratio_max" in r]
    assert len(means) == summary["updates"] >= 3
    assert summary["staleness"]["ratio_mean"] == pytest.approx(sum(means) / len(means))
    # On policy the only gap between mu (int8) and pi (fp32) is int8 rounding: small, but not
    # the rounding-level 1 of an fp32 generator (the test below).
    assert abs(summary["staleness"]["ratio_mean"] - 1) < 0.02
    assert max(maxima) > 1 + 1e-4


def test_in_place_dist_sync_serves_the_weights_the_trainer_trained(ray_session, tmp_path):
    in_place = ["mode=sync", "sync.transport=dist", "sync.in_place=true"]
    _, summary = _run(tmp_path, *in_place)
    sync = summary["sync"]
    assert sync["transport"] == "dist" and sync["lost"] == {} and sync["publishes"] >= 7
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    ratios = [(r["loss/ratio_mean"], r["loss/ratio_max"]) for r in records if "loss/ratio_max" in r]
    assert len(ratios) == summary["updates"] >= 3
    # On policy, the generator sampled with exactly the trainer's weights: pi/mu is 1 up to
    # rounding. A stale, torn or missing update would move it.
    assert all(abs(mean - 1) < 1e-3 and maximum < 1.01 for mean, maximum in ratios), ratios
    # The health metrics every run logs say the same: all weight on-policy, nothing clipped.
    health = [r for r in records if "loss/ess" in r]
    assert len(health) == len(ratios)
    for r in health:
        assert r["loss/ess"] > 0.999 and r["loss/kl_mu_pi"] < 1e-5, r
        assert r["loss/log_ratio_p99"] <= r["loss/log_ratio_max"] < 0.01, r


@pytest.fixture(scope="module")
def refused_then_partial(ray_session, tmp_path_factory) -> tuple[Exception, Path, dict]:
    """A run whose placement the cluster cannot satisfy, then on the same Ray instance a sync run
    with partial rollouts (2 of 4 tokens per generator step): what the first raised, its run
    directory, and the second's summary."""
    root = tmp_path_factory.mktemp("refused")
    cfg = tiny_config(*SMALL, "placement=distributed", "trainer.resources={gpu_node: 1}")
    with pytest.raises(RoleTableError) as refused:
        train(cfg, root / "run")
    partial = ["mode=sync", "generator.max_new_tokens=4", "generator.max_new_tokens_per_step=2"]
    return refused.value, root / "run", train(tiny_config(*SMALL, *partial), root / "next")


def test_sync_with_partial_rollouts_counts_only_batches_that_reached_the_trainer(
    refused_then_partial,
):
    _, _, summary = refused_then_partial
    assert summary["steps"] == 6 and summary["samples"]["accounted"]
    assert summary["samples"]["trained"] >= 6 * 4  # at least one group of 4 per counted step


def test_dataset_task_with_the_sandboxed_math_scorer_through_ray(ray_session, tmp_path):
    data = tmp_path / "sums.jsonl"
    rows = [{"q": f"What is {a}+{a}?", "a": str(2 * a)} for a in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tiny_config(
        *SMALL[:-4],
        "steps=3",
        "model.tokenizer=builtin:byte",
        "model.max_positions=128",
        "task.name=dataset",
        f"task.data={data}",
        "task.prompt_field=q",
        "task.answer_field=a",
        "task.template='{q} Answer:'",
        "task.heldout_size=10",
        "generator.max_new_tokens=6",
        "generator.max_new_tokens_per_step=6",
        "rewarder.scorer=math",
        "rewarder.workers=1",
    )
    summary = train(cfg, tmp_path / "run")
    assert summary["steps"] == 3 and summary["eval"]["end"]["n"] == 10
    samples = summary["samples"]
    assert samples["accounted"] and samples["trained"] == 3 * 16
    assert samples["score_errors"] == 0 and samples["score_timeouts"] == 0


def test_transport_follows_placement():
    assert pick_transport("auto", "n1", ["n1", "n1"]) == "shm"
    assert pick_transport("auto", "n1", ["n1", "n2"]) == "dist"
    assert pick_transport("disk", "n1", ["n2"]) == "disk"
    with pytest.raises(ValueError, match="sync.transport=shm needs the trainer"):
        pick_transport("shm", "n1", ["n2"])


def test_async_replicas_with_partial_rollouts_generate_score_and_serve_every_version(
    ray_session, tmp_path
):
    # Partial rollouts (2 of 4 tokens per generator step) ride along: they keep the books and
    # the bound with replicas as with one generator.
    _, summary = _run(
        tmp_path,
        "mode=async",
        "max_staleness=2",
        "generator.replicas=2",
        "rewarder.replicas=2",
        "generator.max_new_tokens=4",
        "generator.max_new_tokens_per_step=2",
    )
    samples = summary["samples"]
    assert summary["steps"] == 6 and samples["accounted"]
    assert samples["trained"] + samples["dropped_stale"] > 0
    assert summary["staleness"]["max"] <= 2
    replicas = summary["generation"]["replicas"]
    assert set(replicas) == {"generator_0", "generator_1"}
    assert all(r["tokens_generated"] > 0 for r in replicas.values())
    # every replica is a receiver: after the last step each serves the trainer's last version
    assert all(r["version"] == summary["updates"] for r in replicas.values())
    sync = summary["sync"]  # shm, a push transport: every replica takes every version
    assert set(sync["skipped"].values()) == {0}
    assert set(sync["receives"].values()) == {sync["publishes"]}
    busy = summary["perf"]["busy"]
    assert {"generator_0", "generator_1", "rewarder_0", "rewarder_1", "trainer"} == set(busy)
    assert min(busy.values()) > 0
    roles = summary["topology"]["roles"]
    assert [a["name"] for a in roles["generator"]] == ["generator_0", "generator_1"]
    assert summary["topology"]["placement"] == "colocated" and summary["topology"]["nodes"] == 1


def test_async_replicas_with_a_pull_transport_take_only_the_newest_version(ray_session, tmp_path):
    _, summary = _run(
        tmp_path,
        "mode=async",
        "max_staleness=2",
        "generator.replicas=3",
        "sync.transport=object_store",
        "log.eval_every=3",
    )
    samples, sync = summary["samples"], summary["sync"]
    assert samples["accounted"] and summary["staleness"]["max"] <= 2
    assert sync["transport"] == "object_store" and sync["lost"] == {}
    assert sync["publishes"] == summary["updates"] + 1  # version 0, then one per update
    assert all(
        n + sync["skipped"][name] == sync["publishes"] for name, n in sync["receives"].items()
    )
    # A replica takes version 0, then at most the newest before each batch, then the last one
    # after the loop: never an older version than it has, never more often than that.
    trace = json.loads((tmp_path / "run" / "trace.json").read_text())
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    spans = {name: {"generate": [], "update_weights": []} for name in sync["receives"]}
    for e in events:
        if e["ph"] == "X" and names[e["pid"]] in spans and e["name"] in spans[names[e["pid"]]]:
            spans[names[e["pid"]]][e["name"]].append(e["args"]["version"])
    for name, found in spans.items():
        taken = found["update_weights"]
        assert len(taken) == sync["receives"][name] <= len(found["generate"]) + 2
        assert taken == sorted(set(taken)) and taken[-1] == summary["updates"]
    # Evaluations run on the trainer's newest weights, mid-run as at the end.
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    trained = max((r["version"] for r in records if r["step"] <= 3 and "version" in r), default=0)
    assert [r["eval/version"] for r in records if r["step"] == 3 and "eval/version" in r] == [
        trained
    ]
    assert summary["eval"]["end"]["version"] == summary["updates"]


def test_sync_replicas_train_on_both_batches_each_step(sync_run):
    cfg, summary = sync_run
    samples = summary["samples"]
    per_step = 2 * cfg.generator.prompts_per_step * cfg.generator.group_size
    assert samples["generated"] == samples["trained"] == cfg.steps * per_step
    assert summary["staleness"]["max"] == 0 and samples["accounted"]


def test_two_trainer_ranks_with_two_replicas_learn_and_keep_the_books(ray_session, tmp_path):
    cfg, summary = _run(
        tmp_path, "mode=async", "max_staleness=1", "trainer.ranks=2", "generator.replicas=2"
    )
    assert summary["status"] == "finished" and summary["samples"]["accounted"]
    assert summary["staleness"]["max"] <= 1 and summary["updates"] >= 1
    roles = summary["topology"]["roles"]
    assert [a["name"] for a in roles["trainer"]] == ["trainer_0", "trainer_1"]
    sent = summary["sync"]["payload_bytes_per_rank"]
    assert len(sent) == 2 and max(sent) < 0.6 * sum(sent)
    replicas = summary["generation"]["replicas"]
    assert all(r["version"] == summary["updates"] for r in replicas.values())
    warm = Trainer(cfg)  # the same seeded warm start, before any RL step
    warm.warm_start(40)
    before_rl = warm.model.state_dict()
    trained = load_file(tmp_path / "run" / "checkpoint" / "model.safetensors")
    assert set(trained) <= set(before_rl)  # a tied lm_head is saved once, as the embedding
    moved = max((t - before_rl[name]).abs().max().item() for name, t in trained.items())
    assert moved > 1e-3, "RL steps did not change the gathered parameters"


def test_a_placement_the_cluster_cannot_satisfy_fails_the_run_and_says_why(refused_then_partial):
    refused, run, after = refused_then_partial
    assert re.search("^role 'trainer': 1 x gpu_node=1 .* has 0 ", str(refused))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and "gpu_node" in summary["error"]
    # the run released what it had placed: a next run on the same Ray instance still places
    assert after["status"] == "finished"


def test_async_books_balance_when_the_gate_admits_more_batches_than_the_channels_hold(
    ray_session, tmp_path
):
    # max_staleness=4 lets 5 batches start while the two channels and the scoring loop hold 3:
    # when the run ends, batches usually wait on a full channel (how many depends on timing),
    # and must be counted as in flight, not lost from the books.
    cfg, summary = _run(tmp_path, "mode=async", "max_staleness=4", "channels.capacity=1")
    samples = summary["samples"]
    assert samples["accounted"]
    assert (
        samples["generated"] == samples["trained"] + samples["dropped_stale"] + samples["in_flight"]
    )
    assert summary["staleness"]["max"] <= 4


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_forced_lag_trains_every_sample_exactly_that_many_versions_old(
    ray_session, tmp_path, mode
):
    # Zero-signal groups stay in, so every step takes an optimizer step and one version: the
    # lags are then fixed by the schedule alone, whatever the rewards and the timing.
    cfg, summary = _run(
        tmp_path,
        f"mode={mode}",
        "steps=8",
        "generator.min_lag=3",
        "max_staleness=4",
        "channels.capacity=3",
        "experiment.skip_zero_signal=false",
    )
    per_batch = cfg.generator.prompts_per_step * cfg.generator.group_size
    samples = summary["samples"]
    assert summary["updates"] == 8 and samples["accounted"] and samples["dropped_stale"] == 0
    assert samples["trained"] == 8 * per_batch
    # Steps 1-3 train the version-0 batches that filled the pipeline (lags 0, 1, 2), steps 4-8
    # batches exactly 3 versions old.
    hist = {lag: n // per_batch for lag, n in summary["staleness"]["hist"].items()}
    assert hist == {"0": 1, "1": 1, "2": 1, "3": 5}
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    lags = [(r["staleness/mean"], r["staleness/max"]) for r in records if "staleness/max" in r]
    assert lags == [(0, 0), (1, 1), (2, 2)] + [(3, 3)] * 5
    # The three batches generated after the one the last step trained wait (sync: all three,
    # generated; async: those generated when the loop stopped).
    assert 0 <= samples["in_flight"] <= 3 * per_batch
    if mode == "sync":
        assert samples["in_flight"] == 3 * per_batch
    assert summary["staleness"]["min_lag"] == 3
    assert summary["staleness"]["dropped_len_mean"] is None
