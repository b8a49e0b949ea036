"""The LLM workload (LlamaRL): generator replicas sample completion groups, a chain of scoring
stages (rewarders; then stages of your own, a reward model, the reference and the critic where
placed) scores them, and the trainer group learns from them with an off-policy-corrected loss."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray

from relayrl.config import Config
from relayrl.executors.evaluator import heldout_result
from relayrl.executors.generator import Generator
from relayrl.executors.stages import Stage, config_stages
from relayrl.executors.trainer import Trainer
from relayrl.launch import form_trainer_group, publish_weights
from relayrl.observability.books import Books
from relayrl.observability.metrics import MetricsLog, RunTally, say
from relayrl.recovery import DEATHS, Recovery, alive
from relayrl.roles import Group, Placed, Role, ray_resources
from relayrl.types import LoopEnd


class LLMWorkload:
    """Roles ``trainer`` (ranks), ``generator`` (replicas), and one replica group per scoring
    stage: ``stages`` (``relayrl.pipeline.Stage``), by default the config's own
    (``config_stages``: the rewarder, and the reward model, reference and critic where
    configured).

    The scoring stages (``scorers``) are role groups whose ``score`` takes the batch(es) the stage
    before returned and returns ``(summary, batch)``; the loops pass every batch through them in
    order. Stages with ``start_policy`` (the reference, the critic) load the trainer's version 0,
    saved in the run directory (``start_policy/``) once the warm start is done."""

    family = "batches"  # fed by controller.run_sync / run_async: generate -> score -> train

    def __init__(
        self,
        cfg: Config,
        make_env: Any = None,
        *,
        stages: Sequence[Stage] | None = None,
    ):
        if make_env is not None:
            raise ValueError("make_env is for workload=embodied; the LLM workload has no env")
        self.cfg = cfg
        chain = config_stages(cfg) if stages is None else tuple(stages)
        if not chain or chain[0].name != "rewarder":
            raise ValueError("the first scoring stage must be the rewarder: see config_stages")
        self.stage_specs = {stage.name: stage for stage in chain}
        replicas, lag = cfg.generator.replicas, cfg.generator.min_lag
        bound, knob = (lag, "generator.min_lag") if lag else (cfg.max_staleness, "max_staleness")
        if cfg.mode == "async" and replicas > bound + 1:
            say(
                f"warning: generator.replicas={replicas} but the staleness gate lets at most "
                f"{knob} + 1 = {bound + 1} batches be generated at once, so "
                f"{replicas - bound - 1} replica(s) will wait; raise {knob} to use them"
            )
        self.placed = Placed()  # the role table once placed
        self.start_path: str | None = None  # the policy as RL started, once saved
        self.run_dir: Path | None = None  # set by relayrl.job.train
        self.legend: dict[str, str] = {}  # learning-curve labels: the plot's defaults
        self.recovery: Recovery | None = None  # set once weight sync is connected

    def table(self) -> list[Role]:
        """The role table: trainer ranks, generator replicas (they receive the weights and are
        replaced; a replacement samples from seeds of its own), then one row per scoring stage
        (replaced; a ``start_policy`` stage's replacement loads the start policy again, and a
        critic starts learning again from it)."""
        cfg = self.cfg
        ranks, replicas = cfg.trainer.ranks, cfg.generator.replicas
        rows = [
            Role(
                "trainer",
                Trainer,
                ranks,
                lambda r, _: ((cfg,), {"rank": r, "world": ranks}),
                **ray_resources(cfg.trainer.resources),
                keeps="model, optimizer, schedule, version, RNG (each rank writes its own part)",
                saved="own_files",
                traced=True,
                close="close_sync",
            ),
            Role(
                "generator",
                Generator,
                replicas,
                lambda i, k: ((cfg,), {"replica": i + k * replicas}),
                **ray_resources(cfg.generator.resources),
                receives="trainer",
                replaced=True,
                keeps="version, RNGs, unfinished completions, open groups",
                saved="state_dict",
                traced=True,
            ),
        ]
        return rows + [self._stage_role(spec) for spec in self.stage_specs.values()]

    def _stage_role(self, spec: Stage) -> Role:
        """The role of one scoring stage's replicas."""

        def renew(actor: Any, index: int, incarnation: int) -> None:
            actor.load.remote(self.start_path)  # runs before any score call

        return Role(
            spec.name,
            spec.cls,
            spec.replicas,
            lambda i, k: ((self.cfg, *spec.args), dict(spec.kwargs)),
            **ray_resources(spec.resources),
            replaced=True,
            keeps="what its state_dict returns (counters; the critic its model and optimizer)",
            saved="state_dict",
            traced=True,
            close="close" if callable(getattr(spec.cls, "close", None)) else None,
            renew=renew if spec.start_policy else None,
        )

    @property
    def trainer(self) -> Group:
        """The trainer ranks."""
        return self.placed["trainer"]

    @property
    def generators(self) -> Group:
        """The generator replicas."""
        return self.placed["generator"]

    @property
    def rewarders(self) -> Group:
        """The rewarder replicas: the first stage, which also scores evaluations."""
        return self.placed["rewarder"]

    def place(self) -> None:
        """Place the role table and form the trainer's process group."""
        self.placed = Placed.place(self.cfg.placement, self.table())
        form_trainer_group(self.trainer)

    def groups(self) -> list[Group]:
        """Trainer ranks, generator replicas, then the scoring stages."""
        return self.placed.all()

    def scorers(self) -> list[Group]:
        """The scoring stages' groups in the order a batch passes them."""
        return [self.placed[name] for name in self.stage_specs]

    def _start_dir(self) -> Path:
        """Where the policy as RL started lives, for the reference and the critic:
        ``start_policy/`` in the run directory."""
        if self.run_dir is None:
            raise RuntimeError("the workload has no run_dir: relayrl.job.train sets it")
        return Path(self.run_dir) / "start_policy"

    def _from_start(self) -> list[Group]:
        """The groups of the stages that load the policy as RL started."""
        return [self.placed[n] for n, spec in self.stage_specs.items() if spec.start_policy]

    def receivers(self) -> dict[str, Any]:
        """Every generator replica receives the weights."""
        return self.placed.receivers()

    async def snapshot(self) -> dict[str, Any]:
        """For a run checkpoint: every generator's and scoring stage's state (unfinished partial
        rollouts, samplers and random state included), by executor name."""
        return await self.placed.snapshot()

    def restore(self, parts: dict[str, Any]) -> None:
        """Load what ``snapshot`` saved into the generators and scoring stages (the reference and
        the critic reload the start policy from this run directory's copy, wherever the run was
        written)."""
        if self._from_start():
            self.start_path = str(self._start_dir())
            for name in [n for group in self._from_start() for n in group.names]:
                parts[name] = parts[name] | {"path": self.start_path}
        self.placed.restore(parts)

    async def settle(self) -> None:
        """Before a checkpoint: nothing to bring to rest (the loop is between two steps)."""

    async def realign(self, parts: dict[str, Any]) -> None:
        """After a checkpoint: nothing to do (a generator's state holds its partial rollouts)."""

    def prepare(self, log: MetricsLog) -> dict:
        """Warm start (publishing version 0 to every replica), give the reference and the critic
        version 0 (saved to ``start_policy/``), then evaluate held-out."""
        warm = self._warm_start()
        if self._from_start():
            self.start_path = str(self._start_dir())
            ray.get([rank.save_pretrained.remote(self.start_path) for rank in self.trainer])
            ray.get([a.load.remote(self.start_path) for g in self._from_start() for a in g])
        say("evaluating held-out before RL")
        start = asyncio.run(self.evaluate())
        log.log(0, {**{f"eval/{k}": v for k, v in start.items() if k != "per_task"}, **warm})
        return {"warm_start": warm, "eval": {"start": start}}

    def _probe(self) -> float:
        """Greedy accuracy on the warm start's probe of the trainer's own policy (not a
        generator's copy, which may compute in int8), scored by rewarder replica 0."""
        batches = [rank.probe.remote() for rank in self.trainer]
        summary, _ = self.rewarders[0].score.options(num_returns=2).remote(batches[0])
        accuracy = ray.get(summary)["reward_mean"]
        ray.get(batches)
        return accuracy

    async def evaluate(self, split: str = "heldout") -> dict:
        """Greedy accuracy of generator replica 0's policy on a split, and what it cost: the
        LLM evaluation protocol (``relayrl.executors.evaluator.heldout_result``), which
        ``relayrl eval RUN`` plays alike on the saved checkpoint."""
        start = time.time()
        while True:
            generator, rewarder = self.generators[0], self.rewarders[0]
            score_ref, _ = rewarder.score.options(num_returns=2).remote(
                generator.evaluate.remote(split)
            )
            try:
                score = await score_ref
                break
            except DEATHS as err:  # replace the dead one (it serves the newest weights), again
                if self.recovery is None:
                    raise
                for group, actor in ((self.generators, generator), (self.rewarders, rewarder)):
                    if not await alive(actor):
                        await self.recovery.replace(group, 0, err, dead=actor)
        version = (await generator.stats.remote()).version
        return heldout_result(self.cfg.task.name, score, version, time.time() - start)

    def partial_books(self, tally: RunTally) -> dict[str, Books]:
        """The ``samples`` books of a run that stopped early: the controller's counts (it counts
        generation here), with what was in flight unknown."""
        return {"samples": tally.books()}

    def finish(self, tally: RunTally, loop: LoopEnd, rl_wall: float) -> dict:
        """Evaluate held-out again; the eval, perf, staleness and samples sections."""
        end = asyncio.run(self.evaluate())
        stats = ray.get([g.stats.remote() for g in self.generators])
        per_step = {
            name: sum(times) / tally.steps
            for name, times in (
                ("generate", tally.gen_s),
                ("score", tally.score_s),
                ("train", tally.train_s),
            )
        }
        return {
            "eval": {"end": end},
            "generation": {
                "replicas": {
                    name: {
                        "version": s.version,
                        "tokens_generated": s.tokens_generated,
                        "pending": s.pending,
                    }
                    for name, s in zip(self.generators.names, stats, strict=True)
                }
            },
            "perf": {
                "phase_s_per_step": per_step,
                "overlap_bound": sum(per_step.values()) / max(per_step.values()),
            },
            "staleness": tally.staleness()
            | tally.lengths()
            | {"max_staleness": self.cfg.max_staleness, "min_lag": self.cfg.generator.min_lag},
            "stages": {group.role: _stage_books(group) for group in self.scorers()},
            "samples": tally.books(
                in_flight={"pipeline": loop.in_flight},
                lost_unfinished=sum(f.unfinished for f in tally.failures),
                unfinished_partials=sum(s.pending for s in stats),
                score_errors=tally.score_errors,
                score_timeouts=tally.score_timeouts,
            ).section(),
        }

    def _warm_start(self) -> dict:
        """Supervised slices until the probe accuracy reaches the target; publishes version 0."""
        ws, steps, probe = self.cfg.warm_start, 0, 0.0
        metrics: dict = {}
        while steps < ws.max_steps:
            chunk = min(ws.check_every, ws.max_steps - steps)
            metrics = ray.get([rank.warm_start.remote(chunk) for rank in self.trainer])[0]
            steps += chunk
            if ws.target_accuracy > 0:
                probe = self._probe()
                say(
                    f"warm start {steps}/{ws.max_steps} steps: probe accuracy {probe:.3f} "
                    f"(target {ws.target_accuracy})"
                )
                if probe >= ws.target_accuracy:
                    break
            else:
                say(f"warm start {steps}/{ws.max_steps} steps")
        ray.get(publish_weights(self.trainer, self.receivers()))
        return metrics | {"warm_start/steps": steps, "warm_start/probe_accuracy": probe}


def _stage_books(group: Group) -> dict[str, float]:
    """A scoring stage's counters summed over its replicas (a replaced replica's die with it):
    samples scored, errors, timeouts, busy seconds, and the critic's optimizer steps."""
    stats = ray.get([actor.stats.remote() for actor in group])
    books = {
        key: sum(getattr(s, key) for s in stats)
        for key in ("scored", "errors", "timeouts", "busy_s", "updates", "skipped_nonfinite")
    }
    for s in stats:  # a stage of your own's counters
        for key, value in s.counts.items():
            books[key] = books.get(key, 0) + value
    return books
