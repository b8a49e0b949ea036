"""The systems half that every trainer shares: the LLM and VLA policy trainers, the critic and the
world-model trainer.

A trainer is two halves. The learning half (what a batch is, which samples are stale, how the loss
is built) differs per trainer and lives in its own file. The systems half is the same for all and
lives here, in three layers:

- ``GradientStep``, composed by every trainer: AdamW over one module and its learning-rate
  schedule, and the one guarded step (backward, gradients summed over replicated ranks, global
  norm clipped, optimizer step). A bad batch must not end a long run or poison its weights: a nan
  or inf loss or gradient norm skips the step, leaving parameters and optimizer state bit for bit
  as they were, and is counted in ``skipped_nonfinite``.
- ``TrainerCore``, the base of the trainers that publish weights (policy and world model): the
  data-parallel group, the version, weight sync (open, connect, publish, stats, close), the
  tracer, stats, ``state_dict`` and the run checkpoint's part.
- ``PolicyCore``, the base of the two policy trainers: the loss chosen by name with its keyword
  arguments, the ESS learning-rate scale, the ``loss/*`` metrics, the sample books
  (``trained``, ``dropped_stale``) and ``trainer.*``'s optimizer and schedule.

The trainers inherit the last two rather than hold them: a Ray actor serves only the methods of
its own class, so composing them would mean a copy of every delegating method in each trainer,
which is the duplication they remove. The critic publishes nothing and holds a ``GradientStep``.

A trainer may be one rank of a data-parallel group (``trainer.ranks``, ``world_model.ranks``; see
``relayrl.parallel``). The controller creates ``world`` trainers with ``rank=0..world-1``, asks
rank 0 for ``group_address()`` and calls ``join_group(host, port)`` on every rank at once. A
sharded core (the policy) then shards the model with FSDP2 and rebuilds the optimizer and schedule
over the shards, so optimizer state is sharded too, and each rank publishes its own rows. A
replicated core (the world model, small) keeps the whole model on every rank and sums the
gradients over ranks before each step; rank 0 publishes. From then on the training calls,
``save_pretrained`` and (sharded) ``publish`` are made on every rank with the same arguments, and
each rank keeps the books of its own share of the samples.

With ``publish_lag`` = K (embodied: ``inference.min_lag``) the trainer publishes the weights of K
versions ago, which it holds as copies: the policy that acts is then at least K versions behind
the one that trains on its samples, a forced lag for staleness studies. The held copies are part
of ``state_dict``, so a resumed run serves the same old weights.
"""

from __future__ import annotations

import copy
import functools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import torch

from relayrl import checkpoint_format, faults, parallel
from relayrl.algorithms.kl import KL_ESTIMATORS
from relayrl.algorithms.losses import (
    BATCH_STATISTICS,
    LOSS_OPTIONS,
    LOSSES,
    batch_health,
    normalized_ess,
    sequence_log_weights,
)
from relayrl.config import Config
from relayrl.observability.tracing import Span, Tracer
from relayrl.types import TrainerStats
from relayrl.weight_sync import TRANSPORTS, Ticket
from relayrl.weight_sync.base import TrainerSide


def constant_lr(update: int) -> float:
    """The learning-rate factor of a constant schedule: 1 after any number of updates."""
    return 1.0


class GradientStep:
    """AdamW over ``model``'s parameters, its learning-rate schedule, and the guarded step.

    ``grad_clip`` is the global gradient-norm clip (inf: none); ``lr_factor(updates)`` multiplies
    the learning rate after ``updates`` schedule steps. With ``replicated`` (set when a replicated
    core joins its group) the gradients are summed over the ranks before the norm is taken.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        weight_decay: float,
        eps: float = 1e-8,
        grad_clip: float = math.inf,
        lr_factor: Callable[[int], float] = constant_lr,
    ):
        self.model = model
        self.lr, self.weight_decay, self.eps = lr, weight_decay, eps
        self.grad_clip = grad_clip
        self.lr_factor = lr_factor
        self.replicated = False
        self.skipped_nonfinite = 0
        self.build()

    def build(self) -> None:
        """(Re)create the optimizer and schedule over the model's parameters (this rank's shards
        once sharded)."""
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.lr, eps=self.eps, weight_decay=self.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_factor)

    def step(
        self,
        loss: torch.Tensor,
        *,
        lr_scale: float = 1.0,
        writable: Callable[[], object] = lambda: None,
    ) -> tuple[float, bool]:
        """Backward ``loss``, clip the global gradient norm and step the optimizer at its
        learning rate times ``lr_scale`` (for this step only); returns the norm before clipping
        and whether the optimizer stepped. A nan or inf loss (on any rank) or norm skips the
        step, counted in ``skipped_nonfinite``, and leaves the parameters and the optimizer state
        untouched. ``writable()`` is called just before the parameters are written."""
        optimizer = self.optimizer
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        params = list(self.model.parameters())
        if self.replicated:
            parallel.sum_gradients(params)
        norm = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip))
        # The norm is the group's, but the loss is this rank's share, and a nan loss may come with
        # finite gradients (a nan term that carries none). Every rank must decide alike: one that
        # skipped alone would leave its weights, its schedule and its version behind.
        bad = not (math.isfinite(norm) and math.isfinite(float(loss.detach())))
        if parallel.global_metrics({}, {"nonfinite": float(bad)})["nonfinite"]:
            optimizer.zero_grad(set_to_none=True)  # clipping by a nan norm left nan gradients
            self.skipped_nonfinite += 1
            return norm, False
        writable()
        rates = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] *= lr_scale
        optimizer.step()
        for group, rate in zip(optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        return norm, True

    def state_dict(self) -> dict:
        """The optimizer's and the schedule's state and the skip counter (views, not copies)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "skipped_nonfinite": self.skipped_nonfinite,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.skipped_nonfinite = state["skipped_nonfinite"]


class TrainerCore:
    """Group, version, weight sync, tracing, stats and state of a trainer of ``model`` whose
    updates ``gradient_step`` takes; ``sharded`` groups shard the model, others replicate it."""

    name = "trainer"

    def __init__(
        self,
        cfg: Config,
        model: torch.nn.Module,
        gradient_step: GradientStep,
        *,
        rank: int = 0,
        world: int = 1,
        publish_lag: int = 0,
        sharded: bool = True,
    ):
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, world={world}), got rank={rank}")
        self.cfg = cfg
        self.model = model
        self.gradient_step = gradient_step
        self.rank = rank
        self.world = world
        self.sharded = sharded
        self.version = 0
        self.publish_lag = publish_lag
        # (version, copy of the weights) of the versions publish() may still send, oldest first.
        self.held: deque[tuple[int, dict[str, torch.Tensor]]] = deque()
        self.tracer = Tracer(self.name)
        self.sync = TrainerSide(  # a replicated group's rank 0 sends the whole tensors
            timeout_s=cfg.sync.timeout_s,
            bucket_bytes=cfg.sync.bucket_mb << 20,
            streams=cfg.sync.streams,
            in_place=cfg.sync.in_place,
            rank=rank if sharded else 0,
            world=world if sharded else 1,
        )

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The model's optimizer (rebuilt over the shards when a sharded group forms)."""
        return self.gradient_step.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        """The optimizer's learning-rate schedule."""
        return self.gradient_step.scheduler

    @property
    def skipped_nonfinite(self) -> int:
        """Optimizer steps skipped for a nan or inf loss or gradient norm."""
        return self.gradient_step.skipped_nonfinite

    def group_address(self) -> tuple[str, int]:
        """Where rank 0 hosts the group's rendezvous: its IP address and a free port (ask rank
        0, then pass both to every rank's ``join_group``)."""
        return parallel.group_address()

    def join_group(self, host: str, port: int) -> None:
        """Join the trainer group; a sharded core then shards the model and rebuilds the
        optimizer and schedule over the shards, a replicated one sums gradients over the ranks
        from now on. Every rank calls this at once, before the first step and ``open_sync``."""
        if self.world == 1:
            raise RuntimeError("a trainer of world=1 has no group to join")
        if self.optimizer.state or self.sync.publisher is not None:
            raise RuntimeError("join_group() must come before the first step and open_sync()")
        cuda = next(self.model.parameters()).is_cuda
        parallel.join(host, port, self.rank, self.world, cuda=cuda)
        if self.sharded:
            parallel.shard(self.model)
            self.gradient_step.build()
        else:
            self.gradient_step.replicated = True

    def apply_gradients(self, loss: torch.Tensor, lr_scale: float = 1.0) -> tuple[float, bool]:
        """``GradientStep.step`` of ``loss``, which first waits until the sends of the last
        publish no longer read the parameters (``sync.in_place``)."""
        return self.gradient_step.step(loss, lr_scale=lr_scale, writable=self.sync.writable)

    def bump_version(self) -> None:
        """End a train step that updated the model: advance the schedule and the version."""
        self.scheduler.step()
        self.version += 1

    def open_sync(self, transport: str, receivers: list[str], host: str = "127.0.0.1") -> dict:
        """Create the weight-sync publisher; returns the address receivers attach to."""
        return self.sync.open(TRANSPORTS[transport], self.model, receivers, host)

    def connect_sync(self) -> None:
        """Rendezvous with the receivers (they call their ``connect_sync`` meanwhile)."""
        self.sync.publisher.connect()

    def publish(self) -> Ticket:
        """Publish the current weights as the current version (with ``publish_lag`` K: those of
        the oldest held version at most K behind); returns the receivers' ticket."""
        with self.tracer.span("publish", self.version):
            version, state = self._lagged()
            return self.sync.publish(version, state)

    def _lagged(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The version and weights to publish: the current ones, or with ``publish_lag`` the
        oldest held copy no more than ``publish_lag`` versions old (version 0's until then)."""
        state = self.model.state_dict()
        if not self.publish_lag:
            return self.version, state
        if not self.held or self.held[-1][0] != self.version:
            self.held.append((self.version, {k: t.detach().clone() for k, t in state.items()}))
        while self.version - self.held[0][0] > self.publish_lag:
            self.held.popleft()
        return self.held[0]

    def sync_stats(self) -> dict:
        """Trainer-side stall of every publish, in order, and the receivers lost."""
        return self.sync.stats()

    def close_sync(self) -> None:
        """Close the weight-sync publisher before the actor is killed."""
        self.sync.close()

    def stats(self) -> TrainerStats:
        """Counters for the run summary: busy time, version, skipped non-finite steps."""
        return TrainerStats(
            version=self.version,
            busy_s=self.tracer.busy_s(),
            skipped_nonfinite=self.skipped_nonfinite,
        )

    def trace(self) -> tuple[list[Span], list[Span]]:
        """Busy spans and waits recorded so far."""
        return self.tracer.spans, self.tracer.waits

    def _full_model_state(self) -> dict[str, torch.Tensor]:
        """The model's full state dict; in a sharded group, gathered onto rank 0's CPU (a
        collective) and empty on the other ranks."""
        if self.world == 1 or not self.sharded:
            return self.model.state_dict()
        return parallel.full_state_dict(self.model)

    def state_dict(self) -> dict:
        """A snapshot (not a view) of model, optimizer, schedule, skip counter, version, the
        torch generator and the held copies. In a sharded group it is this rank's: the model and
        optimizer state hold its shards (DTensors), so it restores the same rank of a group of
        the same size."""
        return copy.deepcopy(
            {
                "model": self.model.state_dict(),
                **self.gradient_step.state_dict(),
                "version": self.version,
                "torch_rng": torch.get_rng_state(),
                "held": list(self.held),
            }
        )

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved."""
        self.sync.writable()
        self.model.load_state_dict(state["model"])
        self.gradient_step.load_state_dict(state)
        self.version = state["version"]
        torch.set_rng_state(state["torch_rng"])
        self.held = deque(state["held"])

    def save_checkpoint(self, directory: str) -> dict:
        """Write this rank's ``state_dict`` into a run checkpoint's staging directory as
        ``{name}_{rank}.pt``; returns its manifest entry."""
        return checkpoint_format.save_part(directory, self._part, self.state_dict())

    def load_checkpoint(self, directory: str) -> int:
        """Restore this rank from a run checkpoint; returns the restored version."""
        self.load_state_dict(checkpoint_format.load_part(directory, self._part))
        return self.version

    @property
    def _part(self) -> str:
        """This rank's part of a run checkpoint."""
        return f"{self.name}_{self.rank}"


def policy_lr_factor(cfg: Config, update: int) -> float:
    """Multiplier of the policy's learning rate after ``update`` train steps: a linear warmup
    over the first ``trainer.lr_warmup_steps`` (the first step at 1 / warmup of the rate, not at
    0), times cosine over the steps after it to ``trainer.lr_final_ratio``, or constant."""
    tc = cfg.trainer
    warmup = tc.lr_warmup_steps
    factor = min(1.0, (update + 1) / warmup) if warmup else 1.0
    if tc.lr_schedule == "constant":
        return factor
    progress = min(max(update - warmup, 0) / max(cfg.steps - warmup, 1), 1.0)
    final = tc.lr_final_ratio
    return factor * (final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress)))


class PolicyCore(TrainerCore):
    """The core of a policy trainer: ``trainer.*``'s optimizer and schedule over a sharded group,
    the loss by name, its batch statistics and metrics, and the sample books."""

    def __init__(
        self,
        cfg: Config,
        model: torch.nn.Module,
        *,
        adam_eps: float = 1e-8,
        rank: int = 0,
        world: int = 1,
        publish_lag: int = 0,
    ):
        tc = cfg.trainer
        gradient_step = GradientStep(
            model,
            lr=tc.lr,
            weight_decay=tc.weight_decay,
            eps=adam_eps,
            grad_clip=tc.grad_clip,
            lr_factor=functools.partial(policy_lr_factor, cfg),
        )
        super().__init__(cfg, model, gradient_step, rank=rank, world=world, publish_lag=publish_lag)
        self.loss_fn = LOSSES[tc.loss]
        self.loss_kwargs = {kw: getattr(tc, field) for kw, field in LOSS_OPTIONS[tc.loss].items()}
        self.trained = 0
        self.dropped_stale = 0
        self.skipped_masked = 0

    def holds_no_signal(
        self, loss: torch.Tensor, logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
    ) -> bool:
        """Whether the group's ``loss`` kept none of the valid tokens that carry an advantage:
        some token of some rank has a nonzero advantage, yet d loss / d logp is zero on every
        valid token of every rank (masked, rejected or clipped away). An optimizer step would
        then move the weights on Adam's momentum alone, so the caller takes none and counts it
        in ``skipped_masked``. A step whose loss is nan or inf on any rank is left to
        ``GradientStep``'s guard, and one with no advantage at all (zero-signal groups trained
        anyway) steps as before. A collective with ranks: every rank decides alike."""
        valid = mask.bool()
        (grad,) = torch.autograd.grad(loss, logp, retain_graph=True, allow_unused=True)
        kept = 0.0 if grad is None else float((valid & (grad != 0)).sum())
        counts = {
            "kept": kept,
            "signal": float((valid & (advantages != 0)).sum()),
            "nonfinite": float(not math.isfinite(float(loss.detach()))),
        }
        counts = parallel.global_metrics(counts, {})
        return counts["kept"] == 0 and counts["signal"] > 0 and not counts["nonfinite"]

    def loss_options(self, logp: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor) -> dict:
        """The loss's keyword arguments for this batch: the config's, plus the batch statistic
        of a loss that needs one (``BATCH_STATISTICS``), from every rank's tokens (a collective
        with ranks; every rank calls this, a filler with an all-false ``mask``)."""
        if self.cfg.trainer.loss not in BATCH_STATISTICS:
            return self.loss_kwargs
        keyword, contribute, reduce = BATCH_STATISTICS[self.cfg.trainer.loss]
        values = parallel.gather_cat(contribute(logp.detach(), mu, mask))
        return self.loss_kwargs | {keyword: reduce(values, self.loss_kwargs)}

    def _loss_metrics(
        self,
        terms: dict[str, float],
        stats: dict[str, float],
        weight: float,
        grad_norm: float,
        log_ratios: torch.Tensor,
    ) -> dict[str, float]:
        """``loss/*`` metrics of the group's whole batch (collectives with ranks) from this
        rank's loss ``terms`` (already its weighted shares), the loss function's ``stats`` over
        its samples, ``weight`` (its fraction of the samples, 0 for a filler), the global
        gradient norm and its valid tokens' log pi / mu. The stats are token-means but for the
        maxima ``ratio_max`` and ``log_ratio_max``; ``ess`` and ``log_ratio_p99`` come from every
        rank's log-ratios, gathered."""
        peaks = ("ratio_max", "log_ratio_max")
        whole = batch_health(parallel.gather_cat(log_ratios))  # the same on every rank
        shares = terms | {k: weight * v for k, v in stats.items() if k not in (*peaks, *whole)}
        maxima = {"grad_norm": grad_norm} | whole
        maxima |= {k: stats[k] if weight > 0 else 0.0 for k in peaks if k in stats}
        return {f"loss/{k}": v for k, v in parallel.global_metrics(shares, maxima).items()}

    def drift_metrics(
        self, logp: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, float]:
        """How far the policy has drifted from the one that sampled, over every rank's valid
        tokens (``mask``; a collective with ranks, a filler passes an all-false mask):

        - ``staleness/kl_mu_pi``: KL(mu || pi), the token mean of k3 = r - 1 - log r with
          r = pi / mu (``kl.k3`` with mu as the sampler, unbiased from tokens mu sampled);
        - ``staleness/seq_ess``: the normalised ESS of the sequence weights prod(pi / mu)
          (``normalized_ess``; the token-level one is ``loss/ess``);
        - ``loss/entropy_sampled``: the token mean of -log pi over the sampled tokens, the
          policy's per-token entropy estimated from its samples (on policy its expectation is the
          entropy; off policy it is the cross-entropy of mu's tokens under pi).

        The loss's own ``loss/kl_mu_pi`` measures pi against the loss's old policy, the proximal
        one under ``trainer.proximal=current``; this one is always against mu."""
        valid = mask.bool()
        logp = logp.detach().float()
        mu = mu.float()
        sums = {
            "kl": float(torch.where(valid, KL_ESTIMATORS["k3"](mu, logp), 0.0).sum()),
            "nll": float(torch.where(valid, -logp, 0.0).sum()),
            "tokens": float(valid.sum()),
        }
        sums = parallel.global_metrics(sums, {})
        weights = parallel.gather_cat(sequence_log_weights(logp, mu, mask))
        tokens = max(sums["tokens"], 1.0)
        return {
            "staleness/kl_mu_pi": sums["kl"] / tokens,
            "staleness/seq_ess": normalized_ess(weights),
            "loss/entropy_sampled": sums["nll"] / tokens,
        }

    def ess_lr_scale(self, logp: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor) -> float:
        """The learning-rate factor of ``trainer.ess_lr`` (VCPO's rule for Adam): sqrt of the
        normalised ESS of the sequence weights prod(pi/mu) of every rank's rows with a valid
        token (a collective with ranks; a filler passes an all-false ``mask``); 1.0 when off."""
        if not self.cfg.trainer.ess_lr:
            return 1.0
        weights = parallel.gather_cat(sequence_log_weights(logp.detach(), mu, mask))
        return math.sqrt(normalized_ess(weights))

    def publish(self) -> Ticket:
        """``TrainerCore.publish``, past the ``publish`` pause point of the failure tests."""
        faults.reach("publish")
        return super().publish()

    def stats(self) -> TrainerStats:
        """The core's counters plus the samples (completions or env steps) trained and dropped
        stale and the steps skipped for a loss that kept no token."""
        return replace(
            super().stats(),
            trained=self.trained,
            dropped_stale=self.dropped_stale,
            skipped_masked=self.skipped_masked,
        )

    def state_dict(self) -> dict:
        """The core's snapshot plus the sample books and the masked-step counter."""
        return super().state_dict() | {
            "trained": self.trained,
            "dropped_stale": self.dropped_stale,
            "skipped_masked": self.skipped_masked,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved (a snapshot without the masked-step counter: 0)."""
        super().load_state_dict(state)
        self.trained = state["trained"]
        self.dropped_stale = state["dropped_stale"]
        self.skipped_masked = state.get("skipped_masked", 0)
