"""Actors that never touch a tensor (rollout workers, replay buffers, rewarders) start without
torch: what they unpickle imports none (torch costs about 2 s of CPU per process on a 2-core
machine)."""

from __future__ import annotations

import functools
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.config import load_config
from relayrl.executors.worker_side import TaskSampler, build_env


def _runs_without_torch(payload: object, code: str) -> None:
    """Unpickle ``payload`` as ``obj`` in a fresh interpreter, run ``code``, and fail if torch
    was imported."""
    program = (
        "import pickle, sys\n"
        "obj = pickle.loads(sys.stdin.buffer.read())\n"
        f"{code}\n"
        "sys.exit(3 if 'torch' in sys.modules else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], input=pickle.dumps(payload), capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:] or "torch was imported"


def test_a_config_unpickles_without_torch():
    cfg = load_config(None, ["trainer.loss=gipo", "workload=embodied"])
    _runs_without_torch(cfg, "assert obj.trainer.loss == 'gipo'")


def test_a_rollout_workers_env_factory_and_sampler_run_without_torch():
    pytest.importorskip("minigrid", reason='BabyAI needs minigrid: pip install "relayrl[babyai]"')
    cfg = load_config(None, ["workload=embodied", "env.blind=true"])
    payload = (functools.partial(build_env, cfg.env), TaskSampler(cfg.env.tasks, 0))
    code = (
        "import relayrl.executors.rollout_worker, relayrl.executors.replay_buffer\n"
        "make_env, sampler = obj\n"
        "env = make_env(0)\n"
        "obs = env.reset(task=sampler())\n"
        "assert obs.image.shape[-1] == 3 and obs.instruction == 'go to the object'\n"
        "env.step(2)"
    )
    _runs_without_torch(payload, code)


def test_a_rewarder_scores_the_generators_text_without_torch():
    from relayrl.executors.rewarder import Rewarder

    cfg = load_config(None, [])
    code = (
        "import numpy as np\n"
        "from relayrl.types import RolloutBatch\n"
        "cls, cfg = obj\n"
        "batch = RolloutBatch(tokens=np.zeros((2, 3), dtype=np.int64), prompt_len=np.ones(2),\n"
        "    completion_len=np.full(2, 2), logprobs=np.zeros((2, 3), dtype=np.float32),\n"
        "    versions=np.zeros((2, 3), dtype=np.int64), finished=np.ones(2, dtype=bool),\n"
        "    group_size=2, answers=['7', '7'], completions=['7', '8'])\n"
        "assert cls(cfg).score(batch)[1].rewards.tolist() == [1.0, 0.0]"
    )
    _runs_without_torch((Rewarder, cfg), code)


def test_every_function_run_inside_an_actor_loads_without_torch():
    """Ray imports the module of a function sent with ``__ray_call__`` into the actor: every such
    function must come from ``worker_side`` (one defined in ``launch`` once loaded torch into
    every rollout worker and replay buffer)."""
    from relayrl.executors import worker_side

    src = Path(__file__).resolve().parents[1] / "src"
    called = {
        name
        for path in src.rglob("*.py")
        for name in re.findall(r"__ray_call__\.remote\((\w+)", path.read_text())
    }
    assert {"node_of", "set_task_weights", "set_worker_id"} <= called
    elsewhere = sorted(name for name in called if not hasattr(worker_side, name))
    assert elsewhere == [], f"run inside actors but not defined in worker_side: {elsewhere}"
    functions = [getattr(worker_side, name) for name in sorted(called)]
    _runs_without_torch(functions, "assert all(callable(f) for f in obj)")


def test_the_driver_loads_no_model_code_of_transformers():
    """``relayrl train``'s process places the actors but builds no model: importing the job must
    not load ``transformers.modeling_utils`` (about 3 s of CPU per process on a 2-core machine),
    which the generator and trainer actors load when they build their models."""
    program = (
        "import sys, relayrl.cli, relayrl.job\n"
        "sys.exit(3 if 'transformers.modeling_utils' in sys.modules else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:] or "transformers.modeling_utils"
