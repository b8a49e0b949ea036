"""A Ray cluster of two nodes on this machine, started with the `ray` command, for placement tests.

`two_node_cluster()` starts a head node and a second node, each with custom resources of its own
(`node_a` / `node_b` by default), so that a test can pin trainer ranks to one node and generator
replicas to the other. It yields the address and the environment to run drivers under, e.g.
`relayrl train ... --ray-address ADDRESS`: a driver needs that environment to reach the cluster.

How it stays on loopback (Ray 2.60):
- Ray "resolves" 127.0.0.1 / localhost, wherever it is given (`ray start --node-ip-address`,
  `ray start --address`, `ray.init(address=...)`, `ray.init(_node_ip_address=...)`), to the address
  it would use to reach the internet: the eth0 address. `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` makes
  that resolution return 127.0.0.1; every process of the cluster and every driver runs with it. The
  nodes then bind 127.0.0.1 only, so a driver without the variable cannot connect (it dials eth0).
- With that variable `ray start --address=...` refuses to start a non-head node ("not supported on
  Windows and OSX"), so the second node runs the `ray` command's `main` in a Python that lifts that
  check and leaves 127.0.0.1 unresolved (`_WORKER_NODE_MAIN`).
- Both nodes share one short temp dir (Ray's socket paths must fit; the second node reuses the
  head's session dir with `raylet.1` / `plasma_store.1` sockets). The Ray client server gets a free
  port instead of the fixed 10001, and workers take any free port instead of one from 10002-19999,
  so that the two nodes and other clusters on the machine do not collide.
- Clean-up kills only this cluster's processes: those whose command line names the temp dir, and
  all processes of the sessions the two `ray start` commands ran in (the client server and the
  dashboard / runtime-env agents do not name the temp dir). `ray stop` would kill any Ray.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

START_TIMEOUT_S = 60.0
NODES_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0

# The same environment for the cluster and its drivers: see the module docstring.
LOOPBACK_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

_WORKER_NODE_MAIN = """
import sys
import ray._private.ray_constants as constants
import ray._private.services as services
constants.ENABLE_RAY_CLUSTER = True  # lift the non-head-node check, for this process only
services.resolve_ip_for_localhost = lambda host: host  # and keep 127.0.0.1 as given
from ray.scripts.scripts import main
sys.argv[0] = "ray"
sys.exit(main())
"""

_COUNT_ALIVE = """
import sys, ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
print(sum(1 for n in ray.nodes() if n["Alive"]))
"""


def _free_port() -> int:
    """Return a TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_cli() -> str:
    """Return the `ray` command installed next to this Python."""
    ray_cli = shutil.which("ray", path=os.path.dirname(sys.executable))
    if ray_cli is None:
        raise RuntimeError("the ray command is not installed next to this Python")
    return ray_cli


def _tail(text: str | bytes | None, chars: int = 3000) -> str:
    """Return the end of a captured output, as text."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-chars:]


def _start_node(cmd: list[str], env: dict[str, str], sessions: list[int]) -> None:
    """Run one `ray start` in a session of its own, recorded in `sessions` for the clean-up."""
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    sessions.append(proc.pid)
    try:
        out, err = proc.communicate(timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise RuntimeError(f"`ray start` timed out: {cmd}\n{_tail(out)}\n{_tail(err)}") from None
    if proc.returncode != 0:
        raise RuntimeError(
            f"`ray start` failed ({proc.returncode}): {cmd}\n{_tail(out)}\n{_tail(err)}"
        )


def _wait_for_nodes(address: str, env: dict[str, str], count: int) -> None:
    """Wait until a fresh driver process sees `count` alive nodes at `address`."""
    deadline = time.monotonic() + NODES_TIMEOUT_S
    last = ""
    while time.monotonic() < deadline:
        cmd = [sys.executable, "-c", _COUNT_ALIVE, address]
        try:
            result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired as e:
            last = f"the driver timed out:\n{_tail(e.stderr)}"
        else:
            words = result.stdout.split()
            if result.returncode == 0 and words and words[-1] == str(count):
                return
            last = f"rc={result.returncode} stdout={result.stdout!r}\n{_tail(result.stderr)}"
        time.sleep(0.5)
    raise RuntimeError(f"{count} alive nodes not seen at {address} in {NODES_TIMEOUT_S} s: {last}")


def _cluster_pids(temp_dir: str, sessions: list[int]) -> list[int]:
    """Return the live (not zombie) processes that name `temp_dir` or run in `sessions`."""
    mine = {os.getpid(), os.getppid()}
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in mine:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        state, session = fields[0], int(fields[3])  # after "(comm)": state ppid pgrp session
        if state != b"Z" and (session in sessions or temp_dir in cmdline):
            pids.append(int(entry))
    return pids


def _stop(temp_dir: str, sessions: list[int]) -> None:
    """Kill every process of this cluster (and no other), then remove its temp dir."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while pids := _cluster_pids(temp_dir, sessions):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of the cluster in {temp_dir} survived SIGKILL: {pids}")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    shutil.rmtree(temp_dir, ignore_errors=True)


@contextlib.contextmanager
def two_node_cluster(
    cpus_per_node: int = 1,
    head_resources: dict[str, float] | None = None,
    worker_resources: dict[str, float] | None = None,
    object_store_bytes: int = 256 * 2**20,
) -> Iterator[tuple[str, dict[str, str]]]:
    """Start a 2-node Ray cluster on 127.0.0.1; yield its address and the env for its drivers."""
    head_resources = {"node_a": 1.0} if head_resources is None else head_resources
    worker_resources = {"node_b": 1.0} if worker_resources is None else worker_resources
    ray_cli = _ray_cli()
    temp_dir = tempfile.mkdtemp(prefix="rr2", dir="/tmp")  # short: Ray's socket paths must fit
    port = _free_port()
    address = f"127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | LOOPBACK_ENV
    common = ["--node-ip-address=127.0.0.1", f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    common += [f"--num-cpus={cpus_per_node}", "--num-gpus=0"]
    common += ["--min-worker-port=0", "--max-worker-port=0"]  # any free port, not 10002-19999
    common += [f"--object-store-memory={object_store_bytes}"]
    head = [ray_cli, "start", "--head", f"--port={port}", *common, "--include-dashboard=false"]
    head += [f"--ray-client-server-port={_free_port()}"]
    head += [f"--resources={json.dumps(head_resources)}"]
    worker = [sys.executable, "-c", _WORKER_NODE_MAIN, "start", f"--address={address}", *common]
    worker += [f"--resources={json.dumps(worker_resources)}"]
    sessions: list[int] = []
    try:
        _start_node(head, env, sessions)
        _start_node(worker, env, sessions)
        _wait_for_nodes(address, env, 2)
        yield address, env
    finally:
        _stop(temp_dir, sessions)


if __name__ == "__main__":
    t0 = time.monotonic()
    with two_node_cluster() as (addr, _):
        t1 = time.monotonic()
        print(f"up at {addr} in {t1 - t0:.1f} s")
    print(f"down in {time.monotonic() - t1:.1f} s")
