"""The systems half that the LLM trainer and the VLA trainer share.

A trainer is two halves. The learning half (what a batch is, which samples are stale, how the loss
is built) differs per workload and lives in ``trainer.py`` and ``vla_trainer.py``. The systems half
is the same for both and lives here: the optimizer and its learning-rate schedule, the loss chosen
by name with its keyword arguments, the policy version, the sample counters, weight sync
(open, connect, publish, stats, close) and the tracer.

A bad batch must not end a long run or poison its weights: ``apply_gradients`` skips the optimizer
step when the loss or the gradient norm is nan or inf, leaving parameters and optimizer state bit
for bit as they were, and counts it in ``skipped_nonfinite``.

Both trainers inherit it rather than hold it: a Ray actor serves only the methods of its own
class, so composing the core would mean a copy of every delegating method in each trainer, which
is the duplication this class removes.

A trainer may be one rank of a data-parallel group (``trainer.ranks``; see ``relayrl.parallel``).
The controller creates ``world`` trainers with ``rank=0..world-1``, asks rank 0 for
``group_address()`` and calls ``join_group(host, port)`` on every rank at once: the model is then
sharded with FSDP2 and the optimizer and schedule are rebuilt over the shards, so optimizer state
is sharded too. From then on ``train_step``, ``warm_start``, ``save_pretrained`` and ``publish``
are called on every rank with the same arguments (each publishes its own rows), and each rank
keeps the books of its own share of the samples.

With ``publish_lag`` = K (embodied: ``inference.min_lag``) the trainer publishes the weights of K
versions ago, which it holds as copies: the policy that acts is then at least K versions behind
the one that trains on its samples, a forced lag for staleness studies. The held copies are part
of ``state_dict``, so a resumed run serves the same old weights.
"""

from __future__ import annotations

import copy
import math
from collections import deque

import torch

from relayrl import checkpoint_format, faults, parallel
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
from relayrl.weight_sync import TRANSPORTS, Ticket
from relayrl.weight_sync.base import TrainerSide


class TrainerCore:
    """Optimizer, schedule, loss, version, counters, weight sync and tracing of one trainer."""

    name = "trainer"

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
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, world={world}), got rank={rank}")
        self.cfg = cfg
        self.model = model
        self.rank = rank
        self.world = world
        self.adam_eps = adam_eps
        tc = cfg.trainer
        self.optimizer, self.scheduler = self._optimizer()
        self.loss_fn = LOSSES[tc.loss]
        self.loss_kwargs = {kw: getattr(tc, field) for kw, field in LOSS_OPTIONS[tc.loss].items()}
        self.version = 0
        self.trained = 0
        self.dropped_stale = 0
        self.skipped_nonfinite = 0
        self.publish_lag = publish_lag
        # (version, copy of the weights) of the versions publish() may still send, oldest first.
        self.held: deque[tuple[int, dict[str, torch.Tensor]]] = deque()
        self.tracer = Tracer(self.name)
        self.sync = TrainerSide(
            timeout_s=cfg.sync.timeout_s,
            bucket_bytes=cfg.sync.bucket_mb << 20,
            streams=cfg.sync.streams,
            in_place=cfg.sync.in_place,
            rank=rank,
            world=world,
        )

    def _optimizer(self) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        """AdamW over the model's parameters (this rank's shards once in a group), its schedule."""
        tc = self.cfg.trainer
        optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=tc.lr, eps=self.adam_eps, weight_decay=tc.weight_decay
        )
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_factor)

    def group_address(self) -> tuple[str, int]:
        """Where rank 0 hosts the group's rendezvous: its IP address and a free port (ask rank
        0, then pass both to every rank's ``join_group``)."""
        return parallel.group_address()

    def join_group(self, host: str, port: int) -> None:
        """Join the trainer group, shard the model and rebuild the optimizer and schedule over
        the shards; every rank calls this at once, before the first step and ``open_sync``."""
        if self.world == 1:
            raise RuntimeError("a trainer of world=1 has no group to join")
        if self.optimizer.state or self.sync.publisher is not None:
            raise RuntimeError("join_group() must come before the first step and open_sync()")
        cuda = next(self.model.parameters()).is_cuda
        parallel.join(host, port, self.rank, self.world, cuda=cuda)
        parallel.shard(self.model)
        self.optimizer, self.scheduler = self._optimizer()

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

    def ess_lr_scale(self, logp: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor) -> float:
        """The learning-rate factor of ``trainer.ess_lr`` (VCPO's rule for Adam): sqrt of the
        normalised ESS of the sequence weights prod(pi/mu) of every rank's rows with a valid
        token (a collective with ranks; a filler passes an all-false ``mask``); 1.0 when off."""
        if not self.cfg.trainer.ess_lr:
            return 1.0
        weights = parallel.gather_cat(sequence_log_weights(logp.detach(), mu, mask))
        return math.sqrt(normalized_ess(weights))

    def apply_gradients(
        self, loss: torch.Tensor, optimizer: torch.optim.Optimizer, lr_scale: float = 1.0
    ) -> tuple[float, bool]:
        """Backward ``loss``, clip the global gradient norm and step ``optimizer`` at its
        learning rate times ``lr_scale`` (for this step only); returns the norm before clipping
        and whether the optimizer stepped. A nan or inf loss (on any rank) or norm skips the
        step, counted in ``skipped_nonfinite``, and leaves the parameters and the optimizer state
        untouched. The model is not written until the sends in flight are done."""
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.grad_clip)
        norm = float(norm)
        # The norm is the group's, but the loss is this rank's share, and a nan loss may come with
        # finite gradients (a nan term that carries none). Every rank must decide alike: one that
        # skipped alone would leave its shard of the weights, its schedule and its version behind.
        bad = not (math.isfinite(norm) and math.isfinite(float(loss.detach())))
        if parallel.global_metrics({}, {"nonfinite": float(bad)})["nonfinite"]:
            optimizer.zero_grad(set_to_none=True)  # clipping by a nan norm left nan gradients
            self.skipped_nonfinite += 1
            return norm, False
        self.sync.writable()  # in place: the sends of the last publish read these tensors
        rates = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] *= lr_scale
        optimizer.step()
        for group, rate in zip(optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        return norm, True

    def bump_version(self) -> None:
        """End a train step that updated the policy: advance the schedule and the version."""
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
        faults.reach("publish")
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

    def stats(self) -> dict[str, float]:
        """Counters for the run summary (samples are completions or env steps)."""
        return {
            "busy_s": self.tracer.busy_s(),
            "version": self.version,
            "trained": self.trained,
            "dropped_stale": self.dropped_stale,
            "skipped_nonfinite": self.skipped_nonfinite,
        }

    def trace(self) -> tuple[list[Span], list[Span]]:
        """Busy spans and waits recorded so far."""
        return self.tracer.spans, self.tracer.waits

    def _full_model_state(self) -> dict[str, torch.Tensor]:
        """The model's full state dict; in a group, gathered onto rank 0's CPU (a collective)
        and empty on the other ranks."""
        if self.world == 1:
            return self.model.state_dict()
        return parallel.full_state_dict(self.model)

    def state_dict(self) -> dict:
        """A snapshot (not a view) of model, optimizer, schedule, version and counters. In a
        group it is this rank's: the model and optimizer state hold its shards (DTensors) and the
        counters its books, so it restores the same rank of a group of the same size."""
        return copy.deepcopy(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "version": self.version,
                "trained": self.trained,
                "dropped_stale": self.dropped_stale,
                "skipped_nonfinite": self.skipped_nonfinite,
                "torch_rng": torch.get_rng_state(),
                "held": list(self.held),
            }
        )

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved."""
        self.sync.writable()
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = state["version"]
        self.trained = state["trained"]
        self.dropped_stale = state["dropped_stale"]
        self.skipped_nonfinite = state["skipped_nonfinite"]
        torch.set_rng_state(state["torch_rng"])
        self.held = deque(state["held"])

    def save_checkpoint(self, directory: str) -> dict:
        """Write this rank's ``state_dict`` into a run checkpoint's staging directory as
        ``trainer_{rank}.pt``; returns its manifest entry."""
        return checkpoint_format.save_part(directory, f"trainer_{self.rank}", self.state_dict())

    def load_checkpoint(self, directory: str) -> int:
        """Restore this rank from a run checkpoint; returns the restored policy version."""
        self.load_state_dict(checkpoint_format.load_part(directory, f"trainer_{self.rank}"))
        return self.version

    def _lr_factor(self, update: int) -> float:
        """Multiplier of the learning rate after ``update`` train steps (cosine or constant)."""
        tc = self.cfg.trainer
        if tc.lr_schedule == "constant":
            return 1.0
        progress = min(update / max(self.cfg.steps, 1), 1.0)
        final = tc.lr_final_ratio
        return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress))
