"""Ray and weight sync: start or join Ray, and wire, publish and await the trainer's weights to
its receivers (``WeightSync``).

Where actors go and how a dead one is rebuilt is ``relayrl.roles`` (the role table).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
from dataclasses import dataclass
from typing import Any

import grpc
import ray
from ray._private import services

from relayrl.config import Config
from relayrl.executors.worker_side import node_of
from relayrl.roles import Group
from relayrl.weight_sync import TRANSPORTS, ReceiverLost


class RayStartError(RuntimeError):
    """Ray could not be started or joined; the message is one line: where, what failed, what to
    do."""


# How long joining waits for a Ray head to answer: ray.init itself retries for minutes.
CONNECT_TIMEOUT_S = 5.0
# A GCS call that takes no arguments and answers at once: proof that a Ray head listens.
GCS_PING = "/ray.rpc.NodeInfoGcsService/GetClusterId"


def start_ray(cfg: Config) -> None:
    """Join ``cfg.ray.address`` or start an embedded single-node Ray on loopback; raises
    ``RayStartError`` when neither works. A SIGTERM handler the process had (``relayrl train``
    stops with a checkpoint on SIGTERM) is kept: ``ray.init`` replaces it with one that exits."""
    if ray.is_initialized():
        return
    on_sigterm = signal.getsignal(signal.SIGTERM)
    try:
        _start_ray(cfg)
    finally:
        if callable(on_sigterm) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, on_sigterm)


def _start_ray(cfg: Config) -> None:
    address = cfg.ray.address
    if address is not None:
        # A Ray Client address (ray://, or in RAY_ADDRESS, which ray.init reads for auto) gives
        # up within 30 s by itself.
        client = "://" in address or (
            address == "auto" and "://" in os.environ.get("RAY_ADDRESS", "")
        )
        if not client:
            check_ray_head(address)
        try:
            ray.init(address=address, log_to_driver=True)
        except Exception as err:
            raise _join_error(address, _one_line(err), "check that Ray runs there") from err
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    try:
        ray.init(
            # "local": always a new instance, never a cluster some other process started here
            address="local",
            num_cpus=cfg.ray.num_cpus,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=True,
            configure_logging=False,
        )
    except Exception as err:
        raise RayStartError(f"cannot start an embedded Ray: {_one_line(err)}") from err


def check_ray_head(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Raise ``RayStartError`` unless a Ray head answers at ``address`` (``host:port`` or
    ``auto``) within ``timeout`` seconds: the host is unresolvable, the connection is refused or
    unanswered, or something other than Ray answers."""
    host, _, port = address.rpartition(":")
    try:
        if address != "auto" and not (host and port.isdigit()):
            raise ValueError(address)  # Ray would also log a traceback for an empty host
        # What ray.init dials: auto is the cluster started on this machine, and 127.0.0.1 or
        # localhost become this machine's own address.
        dialled = services.canonicalize_bootstrap_address(address)
    except ConnectionError:
        raise _join_error(
            address, "no Ray runs on this machine", "run `ray start --head`"
        ) from None
    except ValueError:
        raise RayStartError(
            f"cannot join Ray at {address}: not host:port, auto or ray://host:port"
        ) from None
    where = address if dialled == address else f"{address} (dialled as {dialled})"
    host, _, port = dialled.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
        problem = _not_a_ray_head(dialled, timeout)
    except socket.gaierror:
        problem = f"cannot resolve host {host}"
    except ConnectionRefusedError:
        problem = "connection refused"
    except TimeoutError:
        problem = f"no answer within {timeout:g} s"
    except OSError as err:
        problem = err.strerror or repr(err)
    if problem is not None:
        raise _join_error(where, problem, f"run `ray start --head --port={port}` on that machine")


def _not_a_ray_head(address: str, timeout: float) -> str | None:
    """Why the server that accepted a connection at ``address`` is not a Ray head, or None.

    An accepted connection proves little: a proxy or another service may hold the port, and
    ray.init then retries for minutes."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return None  # the GCS then speaks TLS only, with certificates this check does not load
    # Ray's own gRPC clients ignore http_proxy too (unless RAY_grpc_enable_http_proxy)
    with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        try:
            channel.unary_unary(GCS_PING)(b"", timeout=timeout)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                return None  # a head with token auth: ray.init brings the token
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"accepts connections but does not answer as a Ray head within {timeout:g} s"
            return f"something other than a Ray head answers there ({err.details()})"
    return None


def _join_error(where: str, problem: str, todo: str) -> RayStartError:
    """The one-line error for an address Ray cannot be joined at, with what to do about it."""
    return RayStartError(
        f"cannot join Ray at {where}: {problem}; {todo}, or drop --ray-address (ray.address) to "
        "start an embedded Ray"
    )


def _one_line(err: BaseException) -> str:
    """An exception as one line: its type and its message with whitespace runs collapsed."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def pick_transport(requested: str, trainer_node: str, receiver_nodes: list[str]) -> str:
    """The weight-sync transport for a placement: shm on one host, dist across hosts."""
    one_host = all(node == trainer_node for node in receiver_nodes)
    if requested == "auto":
        return "shm" if one_host else "dist"
    if requested == "shm" and not one_host:
        raise ValueError(
            "sync.transport=shm needs the trainer and its receivers on one host; "
            "they were placed on different nodes: use sync.transport=dist or auto"
        )
    return requested


@dataclass(eq=False)
class Update:
    """One ``update_weights`` call handed to a receiver: its ref, its publish (number and
    tickets), and when that publish was seen done (None until then): the receiver's time to take
    it runs from there."""

    ref: Any
    publish: int
    tickets: list[Any]
    ready_s: float | None = None


class WeightSync:
    """A run's weight sync once connected: the transport, the trainer ranks that publish, the
    receivers that take, which publish each receiver was handed last, and its update in flight.

    ``publish(fan_out=True)`` hands every publish to every receiver at once, as a push transport
    (shm, dist) needs. With a pull transport (``Receiver.skips_versions``: object_store, disk) a
    loop that uses a receiver only now and then may ``publish(fan_out=False)`` and ``refresh`` the
    receiver just before using it: one receive per use instead of one per publish per receiver,
    and no calls per receiver after each publish.

    Every update handed out is awaited: a loop calls a receiver through ``watched``, which
    raises ``ReceiverLost`` when the receiver's update fails or is not taken within
    ``timeout_s`` of its publish (the receiver is busy, or the publisher evicted it), so that the
    loop replaces it as it would a dead one.
    """

    def __init__(
        self,
        transport: str,
        trainer: Group,
        receivers: dict[str, Any],
        host: str,
        timeout_s: float = 60.0,
    ):
        self.transport = transport
        self.host = host  # where the trainer ranks' publishers listen (dist)
        self.timeout_s = timeout_s
        self.skips_versions = TRANSPORTS[transport].Receiver.skips_versions
        self.trainer = trainer
        self.receivers = receivers
        self.tickets: list[Any] = []  # refs to the newest publish's tickets, one per rank
        self.publishes = 0
        # Every receiver holds what the trainer published before the loops (``prepare``).
        self.handed = dict.fromkeys(receivers, 0)
        # Each receiver's updates not yet seen taken: the oldest and the newest (those between
        # are dropped, so a receiver nothing watches pins two publishes at most).
        self.updates: dict[str, list[Update]] = {}

    def publish(self, fan_out: bool = True) -> dict[str, Any]:
        """Every trainer rank publishes its shard; with ``fan_out`` every receiver takes the
        version at once. Returns the receivers' ``update_weights`` refs by name (each resolves
        to the version)."""
        if not fan_out and not self.skips_versions:
            raise ValueError(f"sync.transport={self.transport} needs every receiver to take it")
        self.tickets = [rank.publish.remote() for rank in self.trainer]
        self.publishes += 1
        return self.refresh(*self.receivers) if fan_out else {}

    def refresh(self, *names: str) -> dict[str, Any]:
        """Hand each named receiver the newest publish unless it has it; their ``update_weights``
        refs by name (an actor runs its calls in order, so a call submitted next runs on those
        weights)."""
        stale = [name for name in names if self.handed[name] < self.publishes]
        refs = {}
        for name in stale:
            self.handed[name] = self.publishes
            refs[name] = self.receivers[name].update_weights.remote(*self.tickets)
            pending = self.updates.setdefault(name, [])
            if len(pending) == 2:  # the oldest times the receiver, the newest is what it serves
                pending.pop()
            pending.append(Update(refs[name], self.publishes, self.tickets))
        return refs

    async def watched(self, name: str, call: Any) -> Any:
        """``await call``, a call on receiver ``name``, and await the receiver's updates with
        it: those handed before the call (Ray runs them first) must have succeeded when the call
        returns, and one handed meanwhile must be taken within ``timeout_s`` of its publish.
        Raises ``ReceiverLost`` otherwise; the receiver's death as it is."""
        before = list(self.updates.get(name, []))
        task = asyncio.ensure_future(_resolved(call))
        task.add_done_callback(_retrieved)  # left behind when the receiver is lost
        while True:
            done, _ = await asyncio.wait({task}, timeout=self.timeout_s / 4)
            if done:
                if isinstance(task.exception(), ray.exceptions.RayActorError):
                    raise task.exception()
                for update in before:
                    await self._taken(name, update)
                return task.result()
            await self._check(name)

    async def updated(self, name: str) -> None:
        """Wait until receiver ``name`` serves the newest publish handed to it; raises as
        ``watched`` does."""
        pending = self.updates.get(name)
        if pending:
            await self.watched(name, pending[-1].ref)

    async def _check(self, name: str) -> None:
        """Raise ``ReceiverLost`` if an update handed to ``name`` failed, or the oldest one not
        taken has waited ``timeout_s`` since its publish was done."""
        pending = list(self.updates.get(name, []))
        if not pending:
            return
        refs = [update.ref for update in pending]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        for update in pending[: len(done)]:  # an actor runs its calls in order
            await self._taken(name, update)
        if len(done) == len(pending):
            return
        oldest, now = pending[len(done)], asyncio.get_running_loop().time()
        if oldest.ready_s is None:
            tickets = oldest.tickets
            published, _ = ray.wait(tickets, num_returns=len(tickets), timeout=0, fetch_local=False)
            if len(published) == len(tickets):
                oldest.ready_s = now
        elif now - oldest.ready_s > self.timeout_s:
            raise ReceiverLost(
                name,
                f"missed sync.timeout_s={self.timeout_s:g}: publish #{oldest.publish} was not "
                f"taken {now - oldest.ready_s:.1f} s after it was ready",
            )

    async def _taken(self, name: str, update: Update) -> None:
        """Await ``update`` (done, or about to be) unless it was seen taken, or a reconnect
        superseded it; a failure is ``ReceiverLost``."""
        pending = self.updates.get(name, [])
        if update not in pending:
            return
        try:
            await update.ref
        except ray.exceptions.RayActorError:
            raise
        except Exception as err:
            cause = getattr(err, "cause", None) or err  # what update_weights raised
            reason = f"{type(cause).__name__}: {' '.join(str(cause).split())[:300]}"
            raise ReceiverLost(name, f"its update failed ({reason})") from err
        if update in pending:
            pending.remove(update)

    def open(self) -> None:
        """Open every trainer rank's publisher for the receivers (by name), give each receiver
        the addresses of all ranks, rendezvous all. Opening again replaces the publishers."""
        names = list(self.receivers)
        addresses = ray.get(
            [rank.open_sync.remote(self.transport, names, self.host) for rank in self.trainer]
        )
        ray.get([r.open_sync.remote(addresses, name) for name, r in self.receivers.items()])
        ray.get(
            [rank.connect_sync.remote() for rank in self.trainer]
            + [r.connect_sync.remote() for r in self.receivers.values()]
        )

    async def reconnect(self, receivers: dict[str, Any]) -> None:
        """Weight sync to ``receivers`` (a replaced one among them): new publishers, every
        receiver attached to them, and the trainer's weights published to all. An update that
        fails here is raised where that receiver is next ``watched``."""
        self.receivers = receivers
        self.updates = {}  # those to the old publishers end with them
        await asyncio.gather(*(rank.close_sync.remote() for rank in self.trainer))
        await asyncio.to_thread(self.open)
        await asyncio.gather(*self.publish().values(), return_exceptions=True)

    def summary(self) -> dict:
        """summary.json's ``sync``: the slowest rank's stall per publish, and every receive.

        Receives are not paired with publishes: a receiver that may skip versions takes only the
        newest when it is used, so each receiver's receives and the publishes it skipped are
        counted (those before the loops included; a push transport skips none).
        """
        trainer = ray.get([rank.sync_stats.remote() for rank in self.trainer])
        receivers = ray.get([r.sync_stats.remote() for r in self.receivers.values()])
        stall = [max(s) for s in zip(*(t["stall_s"] for t in trainer), strict=False)]
        receive = [r for found in receivers for r in found["receive_s"]]
        counts = {n: len(r["receive_s"]) for n, r in zip(self.receivers, receivers, strict=True)}
        stall_mean = sum(stall) / max(len(stall), 1)
        receive_mean = sum(receive) / max(len(receive), 1)
        return {
            "transport": self.transport,
            "publishes": len(stall),
            "mean_s": stall_mean + receive_mean,
            "max_s": max(stall, default=0.0) + max(receive, default=0.0),
            "stall_mean_s": stall_mean,
            "receive_mean_s": receive_mean,
            "receives": counts,
            "skipped": {name: len(stall) - n for name, n in counts.items()},
            "lost": {name: why for t in trainer for name, why in t["lost"].items()},
            "payload_bytes_per_rank": [t["payload_bytes"] for t in trainer],
        }


async def _resolved(call: Any) -> Any:
    return await call


def _retrieved(task: asyncio.Future) -> None:
    """Mark a left-behind call's error as seen (asyncio would log it as never retrieved)."""
    if not task.cancelled():
        task.exception()


def connect_weight_sync(cfg: Config, trainer: Group, receivers: dict[str, Any]) -> WeightSync:
    """Open every trainer rank's publisher for ``receivers`` (by name), give each receiver the
    addresses of all ranks, rendezvous all.

    ``sync.transport=auto`` takes shm only when every receiver shares the trainer's node; a
    transport is one choice for the run, because a receiver takes every rank's shard the same way.
    """
    (trainer_node, trainer_ip), *nodes = ray.get(
        [trainer[0].__ray_call__.remote(node_of)]
        + [r.__ray_call__.remote(node_of) for r in receivers.values()]
    )
    transport = pick_transport(cfg.sync.transport, trainer_node, [node for node, _ in nodes])
    sync = WeightSync(transport, trainer, receivers, trainer_ip, cfg.sync.timeout_s)
    sync.open()
    return sync


def form_trainer_group(trainer: Group) -> None:
    """Form the trainer ranks' process group (rank 0 hosts the rendezvous); one rank has none."""
    if len(trainer) > 1:
        host, port = ray.get(trainer[0].group_address.remote())
        ray.get([rank.join_group.remote(host, port) for rank in trainer])


def publish_weights(trainer: Group, receivers: dict[str, Any]) -> list[Any]:
    """Every trainer rank publishes its shard; every receiver takes all ranks' tickets of the
    version. Returns the receivers' ``update_weights`` refs (each resolves to the version)."""
    tickets = [rank.publish.remote() for rank in trainer]
    return [r.update_weights.remote(*tickets) for r in receivers.values()]
