"""`--ray-address`: the controller joins a Ray cluster started separately with `ray start`."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import TINY
from two_nodes import two_node_cluster

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cluster():
    """A one-node cluster started by the `ray` command, as a user would on a head node.

    It gets a temp dir of its own, and only processes that name that dir are stopped afterwards:
    `ray stop` would also kill the embedded Ray that other tests of this session share.
    """
    ray_cli = shutil.which("ray", path=os.path.dirname(sys.executable))
    if ray_cli is None:
        pytest.skip("the ray command is not installed next to this Python")
    temp_dir = tempfile.mkdtemp(prefix="rrc", dir="/tmp")  # short: Ray's socket paths must fit
    port = _free_port()
    env = os.environ | {"RAY_AUTH_MODE": "disabled"}
    start = [ray_cli, "start", "--head", f"--port={port}", "--num-cpus=2", f"--temp-dir={temp_dir}"]
    start += ["--node-ip-address=127.0.0.1", "--include-dashboard=false", "--disable-usage-stats"]
    subprocess.run(start, env=env, check=True, capture_output=True, timeout=120)
    try:
        yield f"127.0.0.1:{port}", env
    finally:
        subprocess.run(["pkill", "-KILL", "-f", "--", temp_dir], capture_output=True, timeout=60)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_train_joins_an_existing_cluster(cluster, tmp_path):
    address, env = cluster
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "relayrl.cli", "train", "configs/arith.yaml", *TINY, "steps=3"]
    cmd += ["generator.prompts_per_step=4", f"--run-dir={run_dir}", "--ray-address", address]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 3
    resolved = (run_dir / "config.yaml").read_text()
    assert f"address: {address}" in resolved


def test_trainer_ranks_on_one_node_and_replicas_on_the_other_sync_over_dist(tmp_path):
    """Two nodes, each with a custom resource; placement=distributed pins the trainer group to
    node_a and the generator and rewarder replicas to node_b, so weight sync crosses nodes."""
    with two_node_cluster(head_resources={"node_a": 4}, worker_resources={"node_b": 8}) as (
        address,
        env,
    ):
        run_dir = tmp_path / "run"
        cmd = [sys.executable, "-m", "relayrl.cli", "train", "configs/arith.yaml", *TINY]
        cmd += ["steps=4", "mode=async", "max_staleness=1", "generator.prompts_per_step=4"]
        cmd += ["task.digits=1", "task.heldout_size=20", "placement=distributed"]
        cmd += ["trainer.ranks=2", "trainer.resources={node_a: 1}"]
        cmd += ["generator.replicas=2", "generator.resources={node_b: 1}"]
        cmd += ["rewarder.resources={node_b: 1}", f"--run-dir={run_dir}", "--ray-address", address]
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 4
    assert summary["samples"]["accounted"]
    topology = summary["topology"]
    assert topology["placement"] == "distributed" and topology["nodes"] == 2
    roles = topology["roles"]
    trainer_nodes = {a["node"] for a in roles["trainer"]}
    replica_nodes = {a["node"] for a in roles["generator"] + roles["rewarder"]}
    assert len(trainer_nodes) == 1 and len(replica_nodes) == 1
    assert trainer_nodes != replica_nodes
    assert summary["sync"]["transport"] == "dist"  # auto: the receivers are on another node
    assert summary["sync"]["lost"] == {} and summary["sync"]["publishes"] >= 1
