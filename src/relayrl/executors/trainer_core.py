"""The systems half that the LLM trainer and the VLA trainer share.

A trainer is two halves. The learning half (what a batch is, which samples are stale, how the loss
is built) differs per workload and lives in ``trainer.py`` and ``vla_trainer.py``. The systems half
is the same for both and lives here: the optimizer and its learning-rate schedule, the loss chosen
by name with its keyword arguments, the policy version, the sample counters, weight sync
(open, connect, publish, stats, close) and the tracer.

Both trainers inherit it rather than hold it: a Ray actor serves only the methods of its own
class, so composing the core would mean a copy of every delegating method in each trainer, which
is the duplication this class removes.
"""

from __future__ import annotations

import copy
import math

import ray
import torch

from relayrl.algorithms.losses import LOSS_OPTIONS, LOSSES
from relayrl.config import Config
from relayrl.observability.tracing import Span, Tracer
from relayrl.weight_sync import TRANSPORTS, Ticket
from relayrl.weight_sync.base import TrainerSide


class TrainerCore:
    """Optimizer, schedule, loss, version, counters, weight sync and tracing of one trainer."""

    name = "trainer"

    def __init__(self, cfg: Config, model: torch.nn.Module, *, adam_eps: float = 1e-8):
        self.cfg = cfg
        self.model = model
        tc = cfg.trainer
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=tc.lr, eps=adam_eps, weight_decay=tc.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.loss_fn = LOSSES[tc.loss]
        self.loss_kwargs = {kw: getattr(tc, field) for kw, field in LOSS_OPTIONS[tc.loss].items()}
        self.version = 0
        self.trained = 0
        self.dropped_stale = 0
        self.tracer = Tracer(self.name)
        self.sync = TrainerSide(
            timeout_s=cfg.sync.timeout_s,
            bucket_bytes=cfg.sync.bucket_mb << 20,
            streams=cfg.sync.streams,
            in_place=cfg.sync.in_place,
        )

    def apply_gradients(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> float:
        """Backward ``loss``, clip the global gradient norm and step ``optimizer``; returns the
        norm before clipping. The model is not written until the sends in flight are done."""
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.grad_clip)
        self.sync.writable()  # in place: the sends of the last publish read these tensors
        optimizer.step()
        return float(norm)

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
        """Publish the current weights as the current version; returns the receivers' ticket."""
        with self.tracer.span("publish", self.version):
            return self.sync.publish(self.version, self.model.state_dict())

    def node(self) -> tuple[str, str]:
        """The Ray node id and IP address this executor runs on."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

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
        }

    def trace(self) -> tuple[list[Span], list[Span]]:
        """Busy spans and waits recorded so far."""
        return self.tracer.spans, self.tracer.waits

    def state_dict(self) -> dict:
        """A snapshot (not a view) of model, optimizer, schedule, version and counters."""
        return copy.deepcopy(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "version": self.version,
                "trained": self.trained,
                "dropped_stale": self.dropped_stale,
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

    def _lr_factor(self, update: int) -> float:
        """Multiplier of the learning rate after ``update`` train steps (cosine or constant)."""
        tc = self.cfg.trainer
        if tc.lr_schedule == "constant":
            return 1.0
        progress = min(update / max(self.cfg.steps, 1), 1.0)
        final = tc.lr_final_ratio
        return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress))
