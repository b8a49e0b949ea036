"""Shared fixtures and constants: a tiny model config, one embedded Ray instance per test session,
the sizes of the small end-to-end runs, and what several test modules build their cases from (test
modules import from here, never from each other)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import torch

from relayrl import job
from relayrl.algorithms.losses import gipo_loss
from relayrl.checkpoint_format import DIRECTORY
from relayrl.config import Config, load_config
from relayrl.executors.generator import decode_completions
from relayrl.executors.trainer_core import TrainerCore
from relayrl.models.lm import builtin_tokenizer_dir
from relayrl.models.vla import VLAConfig
from relayrl.observability.metrics import MetricsLog
from relayrl.types import RolloutBatch, Segment
from relayrl.workloads import EmbodiedWorkload, LLMWorkload

QUIET = ["log.progress=false", "log.tensorboard=false", "log.report=false"]
TINY = [
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.intermediate_size=64",
    "warm_start.max_steps=0",
    *QUIET,
]


def shm_files() -> set[str]:
    """The weight-sync shared-memory files present now."""
    return {p.name for p in Path("/dev/shm").glob("relayrl-sync-*")}


def orphan_shm_files() -> list[str]:
    """Weight-sync files whose creating process is gone: left behind. Files of runs still going
    (another test process's, under pytest-xdist) are not orphans."""
    return [name for name in shm_files() if not _creator_alive(name)]


def left_shm_files(before: set[str], wait_s: float = 10.0) -> list[str]:
    """The weight-sync files created since ``before`` that a finished run left behind: those whose
    creator is gone once every new file is gone or its creator has exited (up to ``wait_s``; a
    killed actor takes a moment to exit). Files of runs still going elsewhere are not counted."""
    deadline = time.monotonic() + wait_s
    while (new := shm_files() - before) and time.monotonic() < deadline:
        if not any(_creator_alive(name) for name in new):
            break
        time.sleep(0.2)
    return sorted(name for name in shm_files() - before if not _creator_alive(name))


def _creator_alive(name: str) -> bool:
    pid = name.removeprefix("relayrl-sync-").split("-", 1)[0]
    return pid.isdigit() and Path(f"/proc/{pid}").exists()


TOL = {"atol": 1e-5, "rtol": 0.0}  # hand-derived loss numbers are worked to 5 decimals


def close(actual, expected) -> None:
    """Assert that ``actual`` equals the hand-derived ``expected`` to TOL (as float32)."""
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32), torch.tensor(expected), **TOL
    )


def leaf(values: list[list[float]]) -> torch.Tensor:
    """A leaf tensor of ``values`` whose gradient a test reads."""
    return torch.tensor(values, requires_grad=True)


def text_batch(tokenizer, completions: list[str], answers: list[str], finished: list[bool]):
    """One group: prompt "1+2=" then each completion, with EOS where it ``finished``, decoded as
    the generator decodes."""
    prompt = tokenizer("1+2=", add_special_tokens=False)["input_ids"]
    rows = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
    rows = [r + [tokenizer.eos_token_id] * done for r, done in zip(rows, finished, strict=True)]
    width = len(prompt) + max(len(r) for r in rows)
    tokens = np.zeros((len(rows), width), dtype=np.int64)
    versions = np.full((len(rows), width), -1)
    for i, row in enumerate(rows):
        tokens[i, : len(prompt) + len(row)] = prompt + row
        versions[i, len(prompt) : len(prompt) + len(row)] = 0
    return RolloutBatch(
        tokens=tokens,
        prompt_len=np.full(len(rows), len(prompt)),
        completion_len=np.array([len(r) for r in rows]),
        logprobs=np.zeros((len(rows), width), dtype=np.float32),
        versions=versions,
        finished=np.array(finished),
        group_size=len(rows),
        answers=answers,
        completions=decode_completions(tokenizer, rows),
    )


def tiny_config(*overrides: str) -> Config:
    """A config small enough for unit tests: a 1-layer, 32-wide Llama and no warm start (an
    embodied one only turns the progress bar and TensorBoard off)."""
    base = QUIET if "workload=embodied" in overrides else TINY
    return load_config(None, [*base, *overrides])


@pytest.fixture(scope="session")
def ray_session():
    """One embedded Ray instance for every test that needs it (start-up costs seconds)."""
    import ray

    from relayrl.launch import start_ray

    start_ray(tiny_config())
    yield ray
    ray.shutdown()


# The small LLM run: 6 steps of 1-digit addition after a 40-step warm start.
SMALL_LLM = [
    "steps=6",
    "log.every=1",
    "generator.prompts_per_step=4",
    "generator.group_size=4",
    "generator.max_new_tokens=4",
    "generator.max_new_tokens_per_step=4",
    "task.digits=1",
    "task.heldout_size=20",
    "warm_start.max_steps=40",
    "warm_start.target_accuracy=0",
    "warm_start.lr=1e-2",
    "trainer.lr=1e-2",
]

# The small embodied run: 3 steps on BabyAI at 28 pixels with a tiny VLA and two workers.
SMALL_EMBODIED = [
    "workload=embodied",
    "steps=3",
    "log.every=1",
    "env.image_size=28",
    "env.max_steps=12",
    "env.eval_episodes=4",
    "env.eval_workers=1",
    "vla.patch_size=4",
    "vla.channels=8",
    "vla.d_model=16",
    "vla.heads=2",
    "vla.max_episode_steps=12",
    "rollout.workers=2",
    "rollout.segment_len=4",
    "replay.batch_steps=16",
    "replay.capacity_steps=64",
    "trainer.minibatch_steps=8",
    "trainer.lr=3e-3",
]

IMAGINING = [  # AcceRL-WM at the small run's size: a round of both models after every step
    "mode=async",
    "world_model.channels=8",
    "world_model.cond_dim=16",
    "world_model.reward_hidden=16",
    "world_model.denoising_steps=2",
    "world_model.max_steps=4",
    "world_model.train_obs_every=1",
    "world_model.train_reward_every=1",
    "world_model.train_steps=2",
    "world_model.batch_size=4",
    "imagination.episodes_per_real=2",
    "imagination.real_ratio=0.5",
    "imagination.buffer_steps=64",
]


def check_books(summary: dict) -> dict:
    """Assert that an embodied run's env steps balance: every one generated was trained, dropped,
    lost or is in flight; return the ``samples`` section."""
    samples = summary["samples"]
    accounted = samples["trained"] + samples["dropped_stale"] + samples["dropped_overflow"]
    accounted += samples["dropped_error"] + samples["dropped_resume"] + samples["lost"]
    accounted += samples["in_flight"]
    assert samples["accounted"] and samples["generated"] == accounted > 0
    return samples


def interrupted_copy(run: Path, at: int, tmp_path: Path, corrupt_after: int | None = None) -> Path:
    """A run directory as a run killed after step ``at`` (and later) would leave it: the config,
    the metrics of every step written so far, checkpoint ``at``, and optionally a newer checkpoint
    whose trainer file is corrupt."""
    copy = tmp_path / "killed"
    (copy / DIRECTORY).mkdir(parents=True)
    for name in ("config.yaml", "metrics.jsonl"):
        shutil.copy(run / name, copy / name)
    shutil.copytree(run / DIRECTORY / f"step-{at:08d}", copy / DIRECTORY / f"step-{at:08d}")
    if corrupt_after is not None:
        later = copy / DIRECTORY / f"step-{corrupt_after:08d}"
        shutil.copytree(run / DIRECTORY / f"step-{corrupt_after:08d}", later)
        data = bytearray((later / "trainer_1.pt").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (later / "trainer_1.pt").write_bytes(bytes(data))
    return copy


# Killing executors mid-run.
MADE: list = []  # the workloads of the runs, where a test can reach their actors


class Kept(LLMWorkload):
    """The LLM workload, kept in ``MADE``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        MADE.append(self)


class KeptEmbodied(EmbodiedWorkload):
    """The embodied workload, kept in ``MADE``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        MADE.append(self)


def actor_pid(actor) -> int:
    """The process id of a Ray actor."""
    return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=60)


def kill_at(monkeypatch, kills: list[tuple[int, str, int, str]]) -> list:
    """Kill ``(step, role, index, how)``: as the run logs step ``step``, the actor ``role[index]``
    of the run, by ``ray.kill`` or ``os.kill``; in the driver, between two of its steps, so that
    no step of these millisecond-long runs outpaces a kill. Returns the kills still to come."""
    todo = sorted(kills)

    class Killing(MetricsLog):
        def log(self, step: int, metrics: dict) -> None:
            super().log(step, metrics)
            while todo and step >= todo[0][0]:
                _, role, index, how = todo.pop(0)
                actor = {g.role: g for g in MADE[-1].groups()}[role][index]
                if how == "ray.kill":
                    ray.kill(actor)
                else:
                    os.kill(actor_pid(actor), signal.SIGKILL)

    monkeypatch.setattr(job, "MetricsLog", Killing)
    return todo


# Data files for the pre-flight check and the command line.
GOOD = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "4+4=", "answer": "8"}]


def write_jsonl(path: Path, rows: list) -> Path:
    """A JSONL file with one line per row; str rows are written as they are."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def write_tokenizer(folder: Path, chars: str, drop: str = "") -> Path:
    """A character-level tokenizer directory with ``chars`` and an unknown token in its vocabulary
    (so an unknown character gives ``<unk>`` instead of an error); ``drop`` is removed before
    tokenizing."""
    spec = json.loads((builtin_tokenizer_dir("char") / "tokenizer.json").read_text())
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    spec["model"]["vocab"] = {token: i for i, token in enumerate([*specials, *chars])}
    if drop:
        spec["normalizer"] = {"type": "Replace", "pattern": {"String": drop}, "content": ""}
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((builtin_tokenizer_dir("char") / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"unk_token": "<unk>"}))
    return folder


# Trainers: a tiny VLA, its segments, losses that fail on chosen calls, bit-identical state.
TINY_VLA = VLAConfig(
    image_size=8,
    patch_size=4,
    channels=4,
    conv_layers=1,
    d_model=8,
    layers=1,
    heads=2,
    instruction_tokens=4,
    hash_buckets=4,
    action_dims=2,
    action_vocab=3,
    max_episode_steps=8,
)


def segment(length: int, *, seed: int, version: int = 0, terminated: bool = False) -> Segment:
    """A random ``TINY_VLA`` segment of ``length`` steps, sampled at ``version``."""
    rng = np.random.default_rng(seed)
    return Segment(
        worker=0,
        episode=seed,
        task="t",
        instruction=["go to the red ball", "open the door"][seed % 2],
        images=rng.integers(0, 256, (length + 1, 1, 8, 8, 3), dtype=np.uint8),
        steps=np.arange(length + 1, dtype=np.int64) + seed,
        actions=rng.integers(0, 3, (length, 2)),
        logprobs=np.full((length, 2), -1.1, np.float32),
        values=np.zeros(length, np.float32),
        rewards=rng.random(length).astype(np.float32),
        versions=np.full(length, version, np.int64),
        terminated=terminated,
        episode_done=terminated,
        success=terminated,
    )


def nan_on_calls(*calls: int):
    """The trainer's loss, but a nan (with finite, zero gradients) on the given 0-based calls:
    one call per minibatch."""
    count = iter(range(1_000_000))

    def loss_fn(logp, mu_logp, advantages, mask, **kwargs):
        loss, stats = gipo_loss(logp, mu_logp, advantages, mask, **kwargs)
        return (loss + float("nan") if next(count) in calls else loss), stats

    return loss_fn


def core_state(trainer: TrainerCore) -> dict:
    """What a skipped step must leave bit for bit: weights, optimizer state, schedule, version."""
    state = trainer.state_dict()
    return {key: state[key] for key in ("model", "optimizer", "scheduler", "version")}


def assert_bit_identical(a, b) -> None:
    """Nested dicts and lists of tensors and plain values, equal bit for bit."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_bit_identical(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_bit_identical(x, y)
    else:
        assert a == b


# Trainer groups: a hang in a collective fails the test at TIMEOUT_S instead of blocking the run.
TIMEOUT_S = 60
ATOL = 1e-5


class RankHost:
    """One rank of one test's group after another, in a process that outlives the groups: its
    torch and model imports (seconds of CPU) are paid once per session, not per rank per test."""

    def __init__(self):
        self.trainer = None

    def build(self, cls: type, args: tuple, rank: int, world: int) -> None:
        """Make this rank's trainer; it joins its group by its own ``join_group``."""
        self.trainer = cls(*args, rank=rank, world=world)

    def call(self, method: str, *args: Any) -> Any:
        """The trainer's ``method``; ``__ray_call__`` applies a function to the trainer, as on
        an actor of the trainer's class."""
        if method == "__ray_call__":
            function, *args = args
            return function(self.trainer, *args)
        return getattr(self.trainer, method)(*args)

    def run(self, function: Any, *args: Any) -> Any:
        """``function(*args)`` in this process (it joins and leaves its own group)."""
        return function(*args)

    def leave(self) -> None:
        """Drop the trainer and leave the default process group, ready for the next one."""
        import gc

        import torch.distributed as dist

        self.trainer = None
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


class Rank:
    """A trainer on a ``RankHost``, called as an actor of the trainer's class is:
    ``rank.train_step.remote(batch)``, ``rank.__ray_call__.remote(function)``."""

    def __init__(self, host: Any):
        self.host = host

    def __getattr__(self, method: str) -> RankMethod:
        if method.startswith("__") and method != "__ray_call__":
            raise AttributeError(method)
        return RankMethod(self.host, method)


class RankMethod:
    """``rank.method``, whose ``remote(*args)`` calls the trainer's method on its host."""

    def __init__(self, host: Any, method: str):
        self.host, self.method = host, method

    def remote(self, *args: Any) -> Any:
        """The call's object reference, as an actor method's ``remote`` returns it."""
        return self.host.call.remote(self.method, *args)


_HOSTS: dict[str, list[Any]] = {}  # Ray job id: the rank hosts started in it


def rank_hosts(world: int) -> list[Any]:
    """``world`` rank hosts of this Ray session, out of any group: those that answer, and new
    ones for the rest."""
    import sys

    hosts = _HOSTS.setdefault(ray.get_runtime_context().get_job_id(), [])
    release(hosts)
    # The driver's import path: a host unpickles what tests send by module (conftest's and the
    # test modules' functions), and pytest put their folders on this path only.
    path = {"PYTHONPATH": os.pathsep.join(sys.path)}
    actor = ray.remote(num_cpus=0, max_restarts=0, runtime_env={"env_vars": path})(RankHost)
    hosts += [actor.remote() for _ in range(world - len(hosts))]
    return hosts[:world]


def release(hosts: list[Any]) -> None:
    """Take ``hosts`` out of their group, or kill them all when one does not answer."""
    try:
        ray.get([h.leave.remote() for h in hosts], timeout=TIMEOUT_S)
    except Exception:
        drop_rank_hosts()


def drop_rank_hosts() -> None:
    """Kill this Ray session's rank hosts, whose group failed: a rank may be stuck in a
    collective or hold a broken group. The next group starts fresh ones."""
    for host in _HOSTS.pop(ray.get_runtime_context().get_job_id(), []):
        ray.kill(host)


@contextmanager
def trainer_group(cls: type, *args: Any, world: int = 2) -> Iterator[list[Any]]:
    """``world`` trainers of ``cls(*args)`` that have joined one group, which they leave on
    exit; after a failure their processes are killed instead."""
    hosts = rank_hosts(world)
    try:
        ray.get(
            [h.build.remote(cls, args, rank, world) for rank, h in enumerate(hosts)],
            timeout=TIMEOUT_S,
        )
        ranks = [Rank(host) for host in hosts]
        host, port = ray.get(ranks[0].group_address.remote(), timeout=TIMEOUT_S)
        on_all(ranks, "join_group", host, port)
        yield ranks
    except BaseException:
        drop_rank_hosts()
        raise
    release(hosts)


def on_ranks(function: Any, *args: Any, world: int = 2) -> list[Any]:
    """``function(rank, world, *args)`` on ``world`` processes at once, the results in rank
    order; ``function`` joins and leaves its own group. After a failure the processes are
    killed."""
    hosts = rank_hosts(world)
    try:
        calls = [h.run.remote(function, rank, world, *args) for rank, h in enumerate(hosts)]
        results = ray.get(calls, timeout=TIMEOUT_S)
    except BaseException:
        drop_rank_hosts()
        raise
    release(hosts)
    return results


def on_all(ranks: list[Any], method: str, *args: Any) -> list[Any]:
    """Call ``method`` on every rank at once with the same arguments, as the controller does."""
    return ray.get([getattr(r, method).remote(*args) for r in ranks], timeout=TIMEOUT_S)


def tiny_reward_model(path: Path, seed: int) -> Path:
    """A tiny random one-label Llama classifier with the character tokenizer, saved at ``path``;
    its score weights are drawn at scale 1 so the score visibly depends on the text (the default
    init scores nearly 0)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from relayrl.models.lm import load_tokenizer

    tokenizer = load_tokenizer(str(builtin_tokenizer_dir("char")))
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
