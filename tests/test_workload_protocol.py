"""A workload is its role table and the ``Workload`` protocol: the loops, the job, the checkpointer
and recovery touch nothing else of it, and a third workload defined here, classes only, runs
both modes through the unchanged controller and ``job.train``."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import ray
import torch
from conftest import SMALL_EMBODIED, SMALL_LLM, tiny_config

from relayrl.config import Config
from relayrl.executors.stages import StageExecutor
from relayrl.executors.trainer_core import GradientStep, TrainerCore
from relayrl.job import train
from relayrl.launch import publish_weights
from relayrl.observability.metrics import MetricsLog, RunTally
from relayrl.observability.tracing import Span, Tracer
from relayrl.roles import Group, Placed, Role
from relayrl.types import LoopEnd, RolloutMeta, StepResult
from relayrl.weight_sync import TRANSPORTS, Ticket
from relayrl.workloads import (
    FAMILIES,
    BatchWorkload,
    EmbodiedWorkload,
    LLMWorkload,
    Workload,
    members,
)


class Recorder:
    """A workload seen through a proxy that records every attribute read or set on it."""

    def __init__(self, inner: Any):
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "touched", set())

    def __getattr__(self, name: str) -> Any:
        self.touched.add(name)
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        self.touched.add(name)
        setattr(self.inner, name, value)


def test_the_protocols_declare_the_job_s_members_and_each_family_s_on_top():
    job = {"family", "placed", "legend", "recovery", "run_dir", "trainer", "place", "prepare"}
    job |= {"evaluate", "settle", "snapshot", "realign", "restore", "finish", "partial_books"}
    assert members(Workload) == job
    assert members(BatchWorkload) == job | {"generators", "rewarders", "scorers"}
    assert members(FAMILIES["segments"]) > job | {"services", "workers", "retire", "fetch"}
    w = Recorder(BanditWorkload(tiny_config()))
    w.run_dir = "here"
    assert w.family == "batches" and w.inner.run_dir == "here"
    assert w.touched == {"run_dir", "family"}


# --- the bandit: K arms, one rewarded; a softmax policy learns to pull it ---------------------

ARMS = 4
REWARDED = 2  # the arm that pays 1; every other pays 0
PULLS = 64  # per generate call


class ArmPolicy(torch.nn.Module):
    """A softmax over ``ARMS`` logits, all 0 at the start: every arm has probability 1/4."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(torch.zeros(ARMS))

    def log_probs(self) -> torch.Tensor:
        return torch.log_softmax(self.logits, dim=0)


@dataclass
class Pulls:
    """One batch of pulls: the arms, their behaviour log-probs and versions, and rewards."""

    arms: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    rewards: np.ndarray

    def __len__(self) -> int:
        return len(self.arms)


class ArmPuller:
    """The generator-like role: pulls ``PULLS`` arms from its copy of the policy, which it takes
    from the trainer through weight sync."""

    name = "generator"

    def __init__(self, cfg: Config, replica: int = 0):
        torch.set_num_threads(1)
        self.model = ArmPolicy()
        self.version = 0
        self.rng = torch.Generator().manual_seed(cfg.run.seed + 1 + 1000 * replica)
        self.sync_cfg = cfg.sync
        self.receiver: Any = None
        self.receive_s: list[float] = []
        self.tracer = Tracer(self.name)

    def generate(self) -> tuple[RolloutMeta, Pulls]:
        start = time.perf_counter()
        with self.tracer.span("generate", self.version), torch.no_grad():
            logp = self.model.log_probs()
            arms = torch.multinomial(logp.exp(), PULLS, replacement=True, generator=self.rng)
            pulls = Pulls(
                arms=arms.numpy(),
                logprobs=logp[arms].numpy(),
                versions=np.full(PULLS, self.version),
                rewards=np.zeros(PULLS, dtype=np.float32),
            )
        busy = time.perf_counter() - start
        return RolloutMeta(PULLS, PULLS, self.version, 0, 0, busy), pulls

    def probability(self, arm: int) -> tuple[float, int]:
        with torch.no_grad():
            return float(self.model.log_probs()[arm].exp()), self.version

    def open_sync(self, addresses: list[dict], name: str = "generator") -> None:
        kind = TRANSPORTS[addresses[0]["kind"]]
        self.receiver = kind.Receiver(
            self.model, addresses, name, timeout_s=self.sync_cfg.timeout_s
        )

    def connect_sync(self) -> None:
        self.receiver.connect()

    def update_weights(self, *tickets: Ticket) -> int:
        stats = self.receiver.receive(tickets)
        self.version = stats.version
        self.receive_s.append(stats.total_s)
        return self.version

    def sync_stats(self) -> dict:
        return {"receive_s": list(self.receive_s)}

    def trace(self) -> tuple[list[Span], list[Span]]:
        return self.tracer.spans, self.tracer.waits

    def state_dict(self) -> dict:
        return {"version": self.version, "rng": self.rng.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.version = state["version"]
        self.rng.set_state(state["rng"])


class ArmRewarder(StageExecutor):
    """The scoring stage: reward 1 for the rewarded arm."""

    name = "rewarder"

    def score(self, batch: Pulls) -> tuple[dict, Pulls]:
        batch.rewards = (batch.arms == REWARDED).astype(np.float32)
        return self.summary(batch), batch


class ArmTrainer(TrainerCore):
    """A policy-gradient step through the shared trainer core: advantage = reward - the batch
    mean, weighted by pi/mu for pulls a version or more old; pulls older than ``max_staleness``
    are dropped and counted."""

    def __init__(self, cfg: Config, rank: int = 0, world: int = 1):
        torch.set_num_threads(1)
        model = ArmPolicy()
        step = GradientStep(model, lr=0.1, weight_decay=0.0)
        super().__init__(cfg, model, step, rank=rank, world=world, sharded=False)

    def train_step(self, batch: Pulls) -> StepResult:
        start = time.perf_counter()
        with self.tracer.span("train_step", self.version):
            lags = self.version - batch.versions
            fresh = lags <= self.cfg.max_staleness
            arms = torch.as_tensor(batch.arms[fresh])
            rewards = torch.as_tensor(batch.rewards[fresh])
            logp = self.model.log_probs()[arms]
            ratio = (logp.detach() - torch.as_tensor(batch.logprobs[fresh])).exp()
            loss = -(ratio * (rewards - rewards.mean()) * logp).mean()
            _, stepped = self.apply_gradients(loss)
            if stepped:
                self.bump_version()
        return StepResult(
            stepped=stepped,
            version=self.version,
            received=len(batch),
            trained=int(fresh.sum()),
            dropped_stale=int((~fresh).sum()),
            lags=np.bincount(lags[fresh]).tolist(),
            train_s=time.perf_counter() - start,
            metrics={"loss/total": float(loss)},
        )

    def save_pretrained(self, directory: str) -> str:
        return directory


class BanditWorkload:
    """Three roles, the ``batches`` family: pull -> reward -> policy-gradient step."""

    family = "batches"

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.placed = Placed()
        self.legend: dict[str, str] = {}
        self.recovery: Any = None
        self.run_dir: Any = None

    def table(self) -> list[Role]:
        cfg = self.cfg
        return [
            Role(
                "trainer",
                ArmTrainer,
                1,
                lambda r, k: ((cfg,), {"rank": r}),
                saved="own_files",
                traced=True,
                close="close_sync",
            ),
            Role(
                "generator",
                ArmPuller,
                1,
                lambda i, k: ((cfg,), {"replica": i + k}),
                receives="trainer",
                replaced=True,
                saved="state_dict",
                traced=True,
            ),
            Role(
                "rewarder",
                ArmRewarder,
                1,
                lambda i, k: ((cfg,), {}),
                replaced=True,
                saved="state_dict",
                traced=True,
            ),
        ]

    @property
    def trainer(self) -> Group:
        return self.placed["trainer"]

    @property
    def generators(self) -> Group:
        return self.placed["generator"]

    @property
    def rewarders(self) -> Group:
        return self.placed["rewarder"]

    def scorers(self) -> list[Group]:
        return [self.rewarders]

    def place(self) -> None:
        self.placed = Placed.place(self.cfg.placement, self.table())

    def prepare(self, log: MetricsLog) -> dict:
        ray.get(publish_weights(self.trainer, self.placed.receivers()))
        start = asyncio.run(self.evaluate())
        log.log(0, {f"eval/{k}": v for k, v in start.items()})
        return {"eval": {"start": start}}

    async def evaluate(self) -> dict:
        accuracy, version = await self.generators[0].probability.remote(REWARDED)
        return {"accuracy": accuracy, "version": version}

    async def settle(self) -> None:
        pass

    async def snapshot(self) -> dict[str, Any]:
        return await self.placed.snapshot()

    async def realign(self, parts: dict[str, Any]) -> None:
        pass

    def restore(self, parts: dict[str, Any]) -> None:
        self.placed.restore(parts)

    def finish(self, tally: RunTally, loop: LoopEnd, rl_wall: float) -> dict:
        end = asyncio.run(self.evaluate())
        return {
            "eval": {"end": end},
            "perf": {},
            "staleness": tally.staleness(),
            "samples": self._books(tally, loop.in_flight),
        }

    def partial_books(self, tally: RunTally) -> dict:
        return {"samples": tally.books()}

    @staticmethod
    def _books(tally: RunTally, in_flight: int) -> dict:
        counted = tally.trained + tally.dropped_stale + tally.lost + in_flight
        return {
            "generated": tally.generated,
            "trained": tally.trained,
            "dropped_stale": tally.dropped_stale,
            "lost": tally.lost,
            "in_flight": in_flight,
            "accounted": tally.generated == counted,
        }


@pytest.fixture
def by_value(ray_session):
    """Ray's workers load this module's classes by value (tests are not an installed package)."""
    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ray_session


def _bandit(mode: str, *overrides: str) -> Config:
    return tiny_config(f"mode={mode}", "steps=8", "log.every=1", "max_staleness=1", *overrides)


def test_a_bandit_of_classes_only_learns_in_sync_mode_with_its_books_balanced(by_value, tmp_path):
    w = Recorder(BanditWorkload(_bandit("sync", "run.checkpoint_every=4")))
    summary = train(w.inner.cfg, tmp_path / "run", workload=w)
    assert summary["status"] == "finished" and summary["steps"] == 8 == summary["updates"]
    # one generator, 64 pulls a step, strictly on-policy: every pull trained, none dropped
    assert summary["samples"] == {
        "generated": 8 * PULLS,
        "trained": 8 * PULLS,
        "dropped_stale": 0,
        "lost": 0,
        "in_flight": 0,
        "accounted": True,
    }
    assert summary["staleness"]["hist"] == {"0": 8 * PULLS}
    start, end = summary["eval"]["start"], summary["eval"]["end"]
    assert start == {"accuracy": pytest.approx(1 / ARMS), "version": 0}
    assert end["version"] == 8 and end["accuracy"] > 0.5  # from 0.25: the rewarded arm rose
    assert set(summary["topology"]["roles"]) == {"trainer", "generator", "rewarder"}
    assert [p.name for p in sorted((tmp_path / "run" / "checkpoints").iterdir())] == [
        "step-00000004"
    ]
    assert w.touched <= members(BatchWorkload), w.touched - members(BatchWorkload)


def test_a_bandit_of_classes_only_learns_in_async_mode_with_its_books_balanced(by_value, tmp_path):
    w = Recorder(BanditWorkload(_bandit("async", "run.checkpoint_every=0")))
    summary = train(w.inner.cfg, tmp_path / "run", workload=w)
    samples = summary["samples"]
    assert summary["status"] == "finished" and summary["steps"] == 8 and samples["accounted"]
    assert samples["generated"] == (
        samples["trained"] + samples["dropped_stale"] + samples["lost"] + samples["in_flight"]
    )
    assert samples["trained"] + samples["dropped_stale"] == 8 * PULLS  # 8 batches received
    assert samples["generated"] % PULLS == 0 and samples["in_flight"] % PULLS == 0
    assert max(int(lag) for lag in summary["staleness"]["hist"]) <= 1
    assert summary["eval"]["end"]["accuracy"] > 0.5 > 1 / ARMS
    assert w.touched <= members(BatchWorkload), w.touched - members(BatchWorkload)


# --- the built-in workloads through the same recorder --------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_llm_loops_and_job_touch_only_protocol_members(ray_session, tmp_path, mode):
    cfg = tiny_config(*SMALL_LLM, f"mode={mode}", "steps=3", "run.checkpoint_every=2")
    w = Recorder(LLMWorkload(cfg))
    assert train(cfg, tmp_path / "run", workload=w)["status"] == "finished"
    assert {"family", "placed", "trainer", "generators", "scorers", "snapshot"} <= w.touched
    assert w.touched <= members(FAMILIES["batches"]), w.touched - members(FAMILIES["batches"])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_embodied_loops_and_job_touch_only_protocol_members(ray_session, tmp_path, mode):
    cfg = tiny_config(*SMALL_EMBODIED, f"mode={mode}", "run.checkpoint_every=2")
    w = Recorder(EmbodiedWorkload(cfg))
    assert train(cfg, tmp_path / "run", workload=w)["status"] == "finished"
    assert {"family", "placed", "trainer", "workers", "services", "snapshot"} <= w.touched
    assert w.touched <= members(FAMILIES["segments"]), w.touched - members(FAMILIES["segments"])
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["samples"]["accounted"]
