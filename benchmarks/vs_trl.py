"""relayrl vs TRL's GRPOTrainer: the same tiny model, task, sample budget and machine.

One supervised warm start (relayrl's trainer, in this process, stopped the way the controller stops
it: at ``warm_start.target_accuracy`` on the probe) gives one checkpoint. Three systems then run the
same number of RL steps from it:

- ``trl``: ``trl.GRPOTrainer`` in this process, on CPU in fp32, with its default loss
  (``loss_type="dapo"``: PPO-clip surrogate, token mean over the batch) and no KL;
- ``relayrl-sync`` and ``relayrl-async``: ``relayrl.job.train`` with AIPO, on Ray.

Hyper-parameters come from one relayrl config (``configs/arith.yaml`` plus overrides) and are
mapped onto ``GRPOConfig``: prompts per step x group size completions per optimizer step,
temperature, completion length, AdamW lr with cosine decay to ``lr_final_ratio`` (TRL:
``cosine_with_min_lr``), gradient clip. The reward is the same exact-answer scorer, 0 without
EOS, and TRL sees exactly relayrl's prompt tokens (BOS + characters) and the same training prompts
in the same order.

Held-out greedy accuracy is measured every ``--eval-every`` steps with relayrl's own evaluation
code (``Generator.evaluate`` + ``Rewarder.score`` on the fixed 1,000-problem split); for TRL a
``TrainerCallback`` runs it on the trainer's model. Evaluation time is excluded from every
training clock. Per system it reports wall-clock to ``--target`` held-out accuracy (at the first
evaluation that reaches it), final accuracy, completions trained per second, seconds per step
and where a step's time goes.

Run from the repository root (needs ``pip install -e ".[bench]"``)::

    python benchmarks/vs_trl.py                                # 600 steps, evaluate every 50
    python benchmarks/vs_trl.py --steps 100 --eval-every 50    # quick check
    python benchmarks/vs_trl.py --trl-threads 1 trainer.lr=1e-3

It writes ``benchmarks/results/vs_trl.json`` and ``.png`` and prints a Markdown table for
``docs/benchmarks.md``. The checkpoint and run directories are temporary.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import random
import shlex
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import accelerate
import datasets
import matplotlib
import matplotlib.pyplot as plt
import ray
import torch
import transformers
import trl
from common import accuracy, git_state, machine, relative, save_result, warm_start
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from trl import GRPOConfig, GRPOTrainer

from relayrl.config import Config, load_config
from relayrl.envs.arithmetic import AdditionTask
from relayrl.executors.generator import Generator
from relayrl.executors.rewarder import SCORERS, Rewarder
from relayrl.job import train
from relayrl.models.lm import build_policy, load_tokenizer

matplotlib.use("Agg")  # benchmark machines have no display

REPO = Path(__file__).resolve().parents[1]
NAME = "vs_trl"
SYSTEMS = ("trl", "relayrl-sync", "relayrl-async")
TRL_PHASES = ("generate", "reward", "rollout other", "loss forward", "backward", "optimizer")
LOSSES = {
    "trl": "TRL GRPO default loss_type='dapo': -min(r A, clip(r, 0.8, 1.2) A), r = pi/sg(pi) = 1 "
    "(on-policy), token mean over the batch; advantages (r - mean) / (unbiased std + 1e-4)",
    "relayrl": "AIPO: -sg(min(pi/mu, rho)) A log pi, mu = sampler log-probs, token mean over the "
    "batch; advantages (r - mean) / (population std + 1e-6); zero-signal groups skipped "
    "(update unchanged)",
}
DIFFERENCES = [
    "Loss: TRL's default GRPO loss (loss_type='dapo') is a PPO-clip surrogate whose ratio is taken "
    "to the detached current policy; with one optimizer step per batch (num_iterations=1, no "
    "gradient accumulation) the ratio is exactly 1, the clip never acts and the gradient is "
    "A * grad log pi, token-averaged over the batch. relayrl's AIPO weights the same term by "
    "sg(min(pi/mu, 4)) with mu recorded by the sampler: in sync mode pi/mu = 1 up to numerics "
    "(the same update); in async mode mu lags pi by up to max_staleness versions.",
    "Advantages: TRL divides by the unbiased group std + 1e-4, relayrl by the population std + "
    "1e-6: TRL's advantages are sqrt(7/8) = 0.935x relayrl's for groups of 8, a constant factor "
    "that Adam's normalisation all but removes.",
    "Work per step: relayrl leaves groups with all-equal rewards out of the forward/backward pass "
    "(experiment.skip_zero_signal, the update is unchanged); TRL runs forward/backward on all "
    "completions and also computes per-token entropy for its logs.",
    "Generation: TRL calls transformers' model.generate (do_sample, top_k=0, top_p=1, KV cache); "
    "relayrl uses its own KV-cached sampler (engines/native.py). Same distribution, different "
    "random streams.",
    "Parallelism: TRL runs generation and training in one process with --trl-threads torch "
    "threads; relayrl runs generator, rewarder and trainer as Ray actors with one thread each, "
    "so relayrl-async uses both cores at once and relayrl-sync mostly one.",
    "Evaluation: the same relayrl code (Generator.evaluate greedy + Rewarder.score on the 1,000 "
    "held-out problems). For TRL it runs in the training process on the trainer's model; for "
    "relayrl in the generator actor, whose weights in async mode may lag the trainer by a "
    "version (eval version in the curve).",
    "Clocks: each starts after the step-0 evaluation and excludes later evaluations; set-up (TRL "
    "trainer construction; Ray start and actor creation) is reported apart as setup_s. In async "
    "mode the controller's evaluation time can include waiting for a generate call already "
    "running, work the pipeline keeps, so subtracting it slightly under-states async training "
    "time (at most about one generate call per evaluation).",
    "Prompts: the same training prompts in the same order (relayrl's generator seed; TRL's "
    "sampler unshuffled). Neither system masks truncated completions: both train on them with "
    "reward 0.",
]


def trl_scorer(name: str) -> Callable[[str, str], float]:
    """The scoring rule a TRL user would call for ``rewarder.scorer`` ``name``: exact matching
    in process, the bounded math verifier, or a ``module:function`` rule imported here."""
    if name in SCORERS:
        return SCORERS[name]
    if name == "math":
        from relayrl.rewards.math import score

        return score
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def main(argv: list[str] | None = None) -> int:
    """Warm-start once, run TRL and relayrl sync/async from it, write JSON + plot, print table."""
    args = parse_args(argv)
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="relayrl-vs-trl-") as tmp:
        tmp_dir = Path(tmp)
        base = load_config(args.config, [*args.overrides, f"steps={args.steps}"])
        print(f"[{NAME}] warm start", file=sys.stderr)
        start_dir = tmp_dir / "start"
        warm = warm_start(base, start_dir)
        print(f"[{NAME}] warm start: {json.dumps(warm)}", file=sys.stderr)
        cfg = load_config(
            args.config,
            [
                *args.overrides,
                f"steps={args.steps}",
                f"model.path={start_dir}",
                "warm_start.max_steps=0",
                f"log.eval_every={args.eval_every}",
                "log.progress=false",
                "log.tensorboard=false",
                f"run.out_dir={tmp_dir}",
            ],
        )
        try:
            for system in args.systems:
                print(f"[{NAME}] {system}", file=sys.stderr)
                with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the table
                    if system == "trl":
                        runs[system] = run_trl(cfg, args, tmp_dir / "trl")
                    else:
                        runs[system] = run_relayrl(cfg, system.split("-")[1], tmp_dir)
                for run in runs.values():
                    run.update(target_reached(run["curve"], args.target))
        finally:
            ray.shutdown()
    config = cfg.model_dump(mode="json", exclude={"mode"})
    config["run"]["out_dir"] = "(temporary)"
    config["model"]["path"] = "(temporary warm-start checkpoint)"
    result = {
        "benchmark": NAME,
        "command": shlex.join(["python", *(relative(arg) for arg in sys.argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine() | versions(),
        "git": git_state(),
        "settings": {
            "config": relative(str(args.config)),
            "steps": args.steps,
            "eval_every": args.eval_every,
            "target_accuracy": args.target,
            "trl_threads": args.trl_threads,
            "relayrl_threads_per_executor": cfg.ray.threads_per_executor,
            "completions_per_step": cfg.generator.prompts_per_step * cfg.generator.group_size,
            "overrides": [relative(item) for item in args.overrides],
        },
        "config": config,
        "losses": LOSSES,
        "differences": DIFFERENCES,
        "warm_start": warm,
        "systems": runs,
    }
    save_result(args.out, NAME, result, plot, markdown_table(result))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``overrides`` are ``a.b=value`` items of the shared relayrl config."""
    parser = argparse.ArgumentParser(
        description="Train the same tiny model with TRL's GRPOTrainer and relayrl (sync, async); "
        "report wall-clock to a held-out accuracy, final accuracy and samples per second.",
    )
    parser.add_argument(
        "--config", type=Path, default=REPO / "configs" / "arith.yaml", help="configs/arith.yaml"
    )
    parser.add_argument("--steps", type=int, default=600, help="RL steps (optimizer steps)")
    parser.add_argument("--eval-every", type=int, default=50, help="held-out evaluation period")
    parser.add_argument("--target", type=float, default=0.6, help="target held-out accuracy")
    parser.add_argument(
        "--trl-threads",
        type=int,
        default=1,
        help="torch threads of the TRL process (on 2 cores, 2 threads made TRL ~7x slower)",
    )
    parser.add_argument(
        "--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="systems to run"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "benchmarks" / "results",
        help="folder for the JSON and PNG (benchmarks/results)",
    )
    parser.add_argument("overrides", nargs="*", help="a.b=value overrides of the shared config")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.eval_every < 1 or args.trl_threads < 1:
        parser.error("--steps, --eval-every and --trl-threads must be >= 1")
    return args


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that adds up the seconds spent in its phases (``phase_s``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.phase_s: dict[str, float] = defaultdict(float)
        super().__init__(*args, **kwargs)

    def _timed(self, name: str, method: Callable, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            self.phase_s[name] += time.perf_counter() - start

    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("generate", super()._generate_single_turn, *args, **kwargs)

    def _calculate_rewards(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("reward", super()._calculate_rewards, *args, **kwargs)

    def _generate_and_score_completions(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("rollout", super()._generate_and_score_completions, *args, **kwargs)

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        """GRPOTrainer.compute_loss (the policy forward pass and the loss), timed."""
        return self._timed("loss forward", super().compute_loss, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """GRPOTrainer.training_step (rollout, forward, backward), timed."""
        return self._timed("training_step", super().training_step, *args, **kwargs)


class HeldoutClock(TrainerCallback):
    """Evaluates held-out every ``every`` steps and keeps a training clock that excludes it.

    The clock starts after the step-0 evaluation in ``on_train_begin``; the optimizer step is
    timed between ``on_pre_optimizer_step`` and ``on_optimizer_step``.
    """

    def __init__(self, evaluate: Callable[[torch.nn.Module], float], every: int):
        self.evaluate, self.every = evaluate, every
        self.curve: list[dict] = []
        self.begin = self.train_s = self.eval_s = self.optimizer_s = 0.0
        self._optimizer_start = 0.0

    def _point(self, step: int, clock: float, model: torch.nn.Module) -> None:
        start = time.perf_counter()
        value = self.evaluate(model)
        spent = time.perf_counter() - start
        self.curve.append(
            {"step": step, "train_time_s": clock, "accuracy": value, "eval_time_s": spent}
        )
        self.eval_s += spent

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        """Evaluate the starting point, then start the clock."""
        self._point(0, 0.0, model)
        self.eval_s = 0.0
        self.begin = time.perf_counter()

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Mark the start of the optimizer step."""
        self._optimizer_start = time.perf_counter()

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Add up optimizer-step time."""
        self.optimizer_s += time.perf_counter() - self._optimizer_start

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        """Evaluate every ``every`` steps and after the last one."""
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            self.train_s = time.perf_counter() - self.begin - self.eval_s
            self._point(state.global_step, self.train_s, model)


def run_trl(cfg: Config, args: argparse.Namespace, out: Path) -> dict:
    """Train with TRL's GRPOTrainer from the shared checkpoint; returns curve and timings."""
    setup_start = time.perf_counter()
    tokenizer = load_tokenizer(cfg.model.path)
    task = AdditionTask(cfg.task.digits, cfg.task.reverse_answer, cfg.task.heldout_size)
    # The same training prompts in the same order as relayrl's generator (its rng seed is
    # run.seed + 1, one task.sample call per step); TRL's sampler is told not to shuffle.
    rng = random.Random(cfg.run.seed + 1)
    problems = [
        p for _ in range(args.steps) for p in task.sample(cfg.generator.prompts_per_step, rng)
    ]
    # TRL tokenizes plain-text prompts with the tokenizer's own special tokens, and the character
    # tokenizer adds none: spell BOS out so TRL's prompt tokens equal PromptCodec.encode()'s.
    dataset = datasets.Dataset.from_dict(
        {
            "prompt": [tokenizer.bos_token + p.prompt for p in problems],
            "answer": [p.answer for p in problems],
        }
    )
    evaluator = Generator(cfg)  # its own weights are replaced by TRL's model at each evaluation
    rewarder = Rewarder(cfg)
    torch.set_num_threads(args.trl_threads)  # after Generator(), which sets its executor's count

    def evaluate(model: torch.nn.Module) -> float:
        evaluator.model = model.eval()
        try:
            return accuracy(evaluator, rewarder, "heldout")
        finally:
            model.train()

    clock = HeldoutClock(evaluate, args.eval_every)
    gc, tc = cfg.generator, cfg.trainer
    final_lr = tc.lr_final_ratio
    config = GRPOConfig(
        output_dir=str(out),
        max_steps=args.steps,
        per_device_train_batch_size=gc.prompts_per_step * gc.group_size,  # completions per step
        gradient_accumulation_steps=1,
        num_generations=gc.group_size,
        max_completion_length=gc.max_new_tokens,
        temperature=gc.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=tc.lr,
        # The same formula as relayrl's cosine; min_lr_rate 1 is relayrl's constant schedule.
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": final_lr if tc.lr_schedule == "cosine" else 1.0},
        warmup_steps=0,
        optim="adamw_torch",  # torch.optim.AdamW with its defaults, as relayrl's trainer
        weight_decay=tc.weight_decay,
        max_grad_norm=tc.grad_clip,
        beta=0.0,
        num_iterations=1,
        loss_type="dapo",
        shuffle_dataset=False,
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        report_to="none",
        logging_steps=cfg.log.every,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=cfg.run.seed,
    )
    scorer = trl_scorer(cfg.rewarder.scorer)
    eos = tokenizer.eos_token_id

    def exact_answer_reward(
        completions: list[str], completion_ids: list[list[int]], answer: list[str], **_: Any
    ) -> list[float]:
        return [
            scorer(text, ref) if eos in ids else 0.0
            for text, ids, ref in zip(completions, completion_ids, answer, strict=True)
        ]

    trainer = TimedGRPOTrainer(
        model=build_policy(cfg.model, tokenizer, cfg.run.seed),
        reward_funcs=exact_answer_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    setup_s = time.perf_counter() - setup_start
    trainer.train()
    threads = torch.get_num_threads()
    steps = trainer.state.global_step
    train_s = clock.train_s
    phases = dict(trainer.phase_s)
    per_step = {
        "generate": phases["generate"],
        "reward": phases["reward"],
        "rollout other": phases["rollout"] - phases["generate"] - phases["reward"],
        "loss forward": phases["loss forward"],
        "backward": phases["training_step"] - phases["rollout"] - phases["loss forward"],
        "optimizer": clock.optimizer_s,
    }
    per_step = {name: seconds / steps for name, seconds in per_step.items()}
    per_step["other"] = train_s / steps - sum(per_step.values())
    logs = [row for row in trainer.state.log_history if "reward" in row]
    samples = steps * gc.prompts_per_step * gc.group_size
    return {
        "loss": LOSSES["trl"],
        "steps": steps,
        "samples_trained": samples,
        "curve": clock.curve,
        "start_accuracy": clock.curve[0]["accuracy"],
        "final_accuracy": clock.curve[-1]["accuracy"],
        "train_wall_clock_s": train_s,
        "eval_s": clock.eval_s,
        "samples_per_s": samples / train_s,
        "step_time_s": train_s / steps,
        "phase_s_per_step": per_step,
        "setup_s": setup_s,
        "torch_threads": threads,
        "trl_logged_step_time_s": _mean(row["step_time"] for row in logs if "step_time" in row),
        "rollout_accuracy_last_log": logs[-1]["reward"] if logs else None,
        "zero_signal_groups_mean": _mean(row["frac_reward_zero_std"] for row in logs),
    }


def run_relayrl(cfg: Config, mode: str, tmp: Path) -> dict:
    """Train with relayrl's controller from the shared checkpoint; returns curve and timings.

    The training clock starts at the step-0 evaluation row of ``metrics.jsonl`` (written just
    before the RL loop starts) and leaves out the time of every evaluation that follows.
    """
    called = time.time()
    summary = train(cfg.model_copy(update={"mode": mode}), tmp / f"relayrl-{mode}")
    run_dir = Path(summary["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [row for row in rows if "eval/accuracy" in row]
    origin = evals[0]["time"]
    curve, eval_s = [], 0.0
    for row in evals:
        during_rl = 0 < row["step"] < summary["steps"]
        clock = row["time"] - row["eval/time_s"] - origin - eval_s if during_rl else 0.0
        curve.append(
            {
                "step": row["step"],
                "train_time_s": clock,
                "accuracy": row["eval/accuracy"],
                "eval_time_s": row["eval/time_s"],
                "version": row["eval/version"],
            }
        )
        eval_s += row["eval/time_s"] if during_rl else 0.0
    perf = summary["perf"]
    train_s = perf["rl_wall_clock_s"] - eval_s
    curve[-1]["train_time_s"] = train_s
    steps = summary["steps"]
    spans = span_seconds(run_dir / "trace.json")
    weight_sync = spans.get("trainer", {}).get("publish", 0.0) + spans.get("generator", {}).get(
        "update_weights", 0.0
    )
    per_step = {
        **{name: perf["phase_s_per_step"][name] for name in ("generate", "score", "train")},
        "weight sync": weight_sync / steps,
    }
    if mode == "sync":  # nothing overlaps: the rest is Ray calls, serialisation, the controller
        per_step["Ray + controller"] = train_s / steps - sum(per_step.values())
    busy = {
        name: (sum(by_name.values()) - sum(s for n, s in by_name.items() if "evaluate" in n))
        / train_s
        for name, by_name in spans.items()
    }
    samples = summary["samples"]["trained"]
    zero_signal = [
        row["rollout/zero_signal_groups"] for row in rows if "rollout/zero_signal_groups" in row
    ]
    return {
        "loss": LOSSES["relayrl"],
        "steps": steps,
        "samples_trained": samples,
        "curve": curve,
        "start_accuracy": summary["eval"]["start"]["accuracy"],
        "final_accuracy": summary["eval"]["end"]["accuracy"],
        "train_wall_clock_s": train_s,
        "eval_s": eval_s,
        "samples_per_s": samples / train_s,
        "step_time_s": train_s / steps,
        "phase_s_per_step": per_step,
        "setup_s": origin - evals[0]["eval/time_s"] - called,
        "torch_threads": cfg.ray.threads_per_executor,
        "busy_excluding_eval": busy,
        "busy_summary": perf["busy"],
        "phase_s_per_step_summary": perf["phase_s_per_step"],
        "staleness": {key: summary["staleness"][key] for key in ("mean", "max", "max_staleness")},
        "samples": summary["samples"],
        "updates": summary["updates"],
        "zero_signal_groups_mean": _mean(zero_signal),
    }


def span_seconds(trace_path: Path) -> dict[str, dict[str, float]]:
    """Seconds of work per executor and span name inside the RL window of a run's trace.json."""
    trace = json.loads(trace_path.read_text())
    start, end = trace["otherData"]["rl_window_us"]
    names = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for event in trace["traceEvents"]:
        if event["ph"] != "X" or event["cat"] != "work":
            continue
        inside = min(event["ts"] + event["dur"], end) - max(event["ts"], start)
        if inside > 0:
            out[names[event["pid"]]][event["name"]] += inside / 1e6
    return {name: dict(by_name) for name, by_name in out.items()}


def target_reached(curve: list[dict], target: float) -> dict:
    """Training wall-clock and step of the first evaluation at or above ``target``, else None."""
    for point in curve:
        if point["accuracy"] >= target:
            return {"time_to_target_s": point["train_time_s"], "steps_to_target": point["step"]}
    return {"time_to_target_s": None, "steps_to_target": None}


def versions() -> dict:
    """Versions of the libraries the comparison depends on."""
    return {
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "datasets": datasets.__version__,
        "torch": torch.__version__,
        "ray": ray.__version__,
    }


def plot(result: dict, path: Path) -> Path:
    """Held-out accuracy vs training wall-clock, and each system's step time by phase."""
    systems = result["systems"]
    target = result["settings"]["target_accuracy"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    for name, run in systems.items():
        xs = [p["train_time_s"] for p in run["curve"]]
        ys = [p["accuracy"] for p in run["curve"]]
        left.plot(xs, ys, marker="o", markersize=3, label=name)
    left.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target:g}")
    left.set_xlabel("training wall-clock, evaluation excluded (s)")
    left.set_ylabel("held-out greedy accuracy")
    left.set_ylim(0, 1)
    left.set_title("held-out accuracy")
    left.legend(fontsize=8)

    phases = [*TRL_PHASES, "other", "score", "train", "weight sync", "Ray + controller"]
    colors = dict(zip(phases, plt.cm.tab20.colors, strict=False))
    for x, (name, run) in enumerate(systems.items()):
        if name == "relayrl-async":  # phases overlap: only the step time is meaningful
            right.bar(x, run["step_time_s"], color="0.55", label="async (overlapped)")
            continue
        bottom = 0.0
        for phase, seconds in run["phase_s_per_step"].items():
            label = phase if phase not in right.get_legend_handles_labels()[1] else None
            right.bar(x, seconds, bottom=bottom, color=colors[phase], label=label)
            bottom += seconds
    right.set_xticks(range(len(systems)), list(systems))
    right.set_ylabel("training wall-clock per step (s)")
    completions = result["settings"]["completions_per_step"]
    right.set_title(f"step time ({completions} completions per step)")
    right.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=4)
    fig.suptitle(
        f"TRL GRPOTrainer vs relayrl, {result['warm_start']['parameters'] / 1e6:.2f}M-param Llama, "
        f"{result['settings']['steps']} steps",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def markdown_table(result: dict) -> str:
    """A table and notes to paste into docs/benchmarks.md."""
    target = result["settings"]["target_accuracy"]
    lines = [
        f"| system | loss | time to {target:g} held-out (s) | steps to {target:g} "
        "| final held-out | samples/s | step time (s) | where a step goes (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, run in result["systems"].items():
        reached = run["time_to_target_s"] is not None
        time_to = f"{run['time_to_target_s']:.1f}" if reached else "not reached"
        steps_to = str(run["steps_to_target"]) if reached else "-"
        phases = ", ".join(f"{k} {v:.3f}" for k, v in run["phase_s_per_step"].items())
        if name == "relayrl-async":
            phases = f"overlapped: {phases}"
        loss = "GRPO (dapo)" if name == "trl" else "AIPO"
        lines.append(
            f"| {name} | {loss} | {time_to} | {steps_to} | {run['final_accuracy']:.3f} "
            f"| {run['samples_per_s']:.0f} | {run['step_time_s']:.3f} | {phases} |"
        )
    warm, settings, m = result["warm_start"], result["settings"], result["machine"]
    lines += [
        "",
        f"All systems start from one warm-start checkpoint ({warm['parameters'] / 1e6:.2f}M "
        f"params, held-out {warm['heldout_accuracy']:.3f}); {settings['steps']} steps of "
        f"{settings['completions_per_step']} completions; held-out greedy accuracy on 1,000 "
        f"problems every {settings['eval_every']} steps, evaluation time excluded; time to target "
        "is read at the first evaluation that reaches it.",
        f"TRL: one process, torch threads: {settings['trl_threads']}; relayrl: three Ray actors, "
        f"torch threads: {settings['relayrl_threads_per_executor']} each.",
        "Groups with all-equal rewards (no signal): "
        + ", ".join(
            f"{name} {100 * run['zero_signal_groups_mean']:.0f}%"
            for name, run in result["systems"].items()
            if run.get("zero_signal_groups_mean") is not None
        )
        + " of groups on average; relayrl leaves them out of forward/backward, TRL does not.",
        f"Command: `{result['command']}`; {m['platform']}, {m['cpu_count']} CPUs, trl {m['trl']}, "
        f"transformers {m['transformers']}, torch {m['torch']}, ray {m['ray']}.",
    ]
    return "\n".join(lines)


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


if __name__ == "__main__":
    sys.exit(main())
