"""Generation throughput: relayrl's native engine in fp32 and int8 against Hugging Face generate.

One small Llama built from sizes (relayrl's ``build_policy``, the byte tokenizer, nothing
downloaded) generates from the same random prompts at each batch size, with the same prompt length
and number of new tokens, sampling at temperature 1 from the full distribution:

- ``native-fp32``: ``relayrl.engines.native.sample_chunk`` on the fp32 model (what the generator
  runs with ``generator.precision=fp32``);
- ``native-int8``: the same on the int8 copy a generator with ``generator.precision=int8`` serves:
  every linear layer an int8 weight-only matmul, built the way the generator builds it
  (``to_int8``, then one publish received over shm in ``precision="int8"``);
- ``hf-fp32`` (and, if asked, ``hf-int8``): ``model.generate(do_sample=True, top_k=0)``.

Every row generates exactly ``--new-tokens`` tokens: EOS is never stopped at (the native engine is
given an EOS id no token has; HF gets ``min_new_tokens``), so every system does the same work.
tokens/s = batch x new tokens / seconds of the fastest of ``--repeats`` timed calls, after one
untimed warm-up call; prefill is included. The systems take turns call by call. It also
reports, per batch size, the mean and largest |mu_int8 - log pi_fp32| of the int8 engine's tokens
(teacher-forced under the fp32 model): the precision part of the gap that AIPO's pi/mu corrects.

With ``--train-steps`` (default: the config's ``steps``; 0 skips it) it then runs the config (by
default ``configs/arith.yaml``, the default job) twice with ``relayrl.job.train``, with
``generator.precision=fp32`` and ``=int8``, and reports each run's warm-start steps, final
held-out accuracy and mean pi/mu ratio (``summary.json``: ``staleness.ratio_mean``).

Run from the repository root::

    python benchmarks/generation.py                      # batch 1..256, then the training runs
    python benchmarks/generation.py --train-steps 0      # throughput only
    python benchmarks/generation.py --batches            # training runs only
    python benchmarks/generation.py --batches 1 4 --new-tokens 4 --repeats 1 --hidden 64 \\
        --layers 2 --intermediate 128 --train-steps 2 warm_start.max_steps=0 \\
        task.heldout_size=20 --out /tmp/generation-smoke    # smoke run (seconds)

It writes ``benchmarks/results/generation.json`` and ``.png`` (``generation_training.*`` for a
run of the training runs only) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import shlex
import sys
import tempfile
import time
from pathlib import Path

import matplotlib
import ray
import torch
import transformers

matplotlib.use("Agg")  # benchmark machines have no display
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    REPO,
    accuracy,
    git_state,
    machine,
    relative,
    save_result,
    train_from,
)

from relayrl.config import Config, ModelConfig, load_config  # noqa: E402
from relayrl.engines.native import sample_chunk  # noqa: E402
from relayrl.executors.generator import Generator  # noqa: E402
from relayrl.executors.rewarder import Rewarder  # noqa: E402
from relayrl.models.lm import build_policy, load_tokenizer  # noqa: E402
from relayrl.weight_sync import TRANSPORTS  # noqa: E402
from relayrl.weight_sync.int8 import to_int8  # noqa: E402

NAME = "generation"
SYSTEMS = ("native-fp32", "native-int8", "hf-fp32", "hf-int8")
NEVER = -1  # an EOS id no token has: every row generates all its new tokens
PAD = 0  # the byte tokenizer's; prompts are all one length, so nothing is padded


def main(argv: list[str] | None = None) -> int:
    """Time every system at every batch size, then the two training runs; write JSON + plot."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer("builtin:byte")
    sizes = ModelConfig(
        tokenizer="builtin:byte",
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        intermediate_size=args.intermediate,
        max_positions=args.prompt_len + args.new_tokens,
    )
    fp32 = build_policy(sizes, tokenizer, seed=0).eval()
    models = {"fp32": fp32, "int8": int8_copy(fp32)}
    # Random bytes past the special tokens (pad 0, EOS 1, BOS 2), the same for every system.
    prompts = torch.randint(
        3,
        len(tokenizer),
        (max(args.batches, default=1), args.prompt_len),
        generator=torch.Generator(),
    ).tolist()
    systems = args.systems if args.batches else []
    throughput: dict[str, dict[str, dict]] = {system: {} for system in systems}
    gaps: dict[str, dict] = {}
    for batch in args.batches:
        times = time_generation(args.systems, models, prompts[:batch], args)
        for system in args.systems:
            throughput[system][str(batch)] = {
                "seconds": times[system],
                "tokens_per_s": batch * args.new_tokens / min(times[system]),
            }
            print(
                f"[{NAME}] batch {batch:4d} {system:12s} "
                f"{throughput[system][str(batch)]['tokens_per_s']:9.1f} tokens/s",
                file=sys.stderr,
            )
        gaps[str(batch)] = precision_gap(fp32, models["int8"], prompts[: min(batch, 64)], args)
    runs = train_runs(args) if args.train_steps != 0 else {}
    result = {
        "benchmark": NAME,
        "command": shlex.join(["python", *(relative(arg) for arg in sys.argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine() | {"transformers": transformers.__version__},
        "git": git_state(),
        "settings": {
            "model": sizes.model_dump(mode="json")
            | {"parameters": sum(p.numel() for p in fp32.parameters())},
            "batches": args.batches,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "threads": args.threads,
            "systems": args.systems,
        },
        "throughput": throughput,
        "int8_logprob_gap": gaps,
        "training": runs,
    }
    # With no batch sizes only the training runs ran: their own file, leaving the timings' alone.
    name = NAME if args.batches else f"{NAME}_training"
    save_result(args.out, name, result, plot, markdown_table(result))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``overrides`` are ``a.b=value`` items for the training runs' config."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--batches",
        type=int,
        nargs="*",
        default=[1, 4, 16, 64, 256],
        help="batch sizes to time (1 4 16 64 256); none: only the training runs",
    )
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS[:3]))
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens in every prompt")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls; the fastest counts")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: what a generator runs with, ray.threads_per_executor)",
    )
    parser.add_argument("--hidden", type=int, default=512, help="width of the Llama")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers")
    parser.add_argument("--heads", type=int, default=8, help="attention heads")
    parser.add_argument("--intermediate", type=int, default=1536, help="MLP width")
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "arith.yaml")
    parser.add_argument(
        "--train-steps",
        type=int,
        default=None,
        help="RL steps of each training run (default: the config's; 0: no training runs)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("overrides", nargs="*", help="a.b=value overrides of the training config")
    return parser.parse_args(argv)


def int8_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The model a ``generator.precision=int8`` generator serves: converted at start, then one
    publish of the fp32 weights received in int8 over shared memory."""
    state = model.state_dict()
    int8 = to_int8(copy.deepcopy(model))
    publisher = TRANSPORTS["shm"].Publisher(state, ["generator"])
    receiver = TRANSPORTS["shm"].Receiver(int8, [publisher.address], "generator", precision="int8")
    receiver.receive([publisher.publish(0, state)])
    publisher.close()  # the receiver serves its own slot, not the shared files
    return int8


def time_generation(
    systems: list[str],
    models: dict[str, torch.nn.Module],
    prompts: list[list[int]],
    args: argparse.Namespace,
) -> dict[str, list[float]]:
    """Seconds of each timed call generating ``args.new_tokens`` for every prompt, by system.
    The systems take turns, call by call, so the noise of a shared machine falls on each alike."""
    runs = {}
    for system in systems:
        engine, precision = system.split("-")
        model, run = models[precision], {"native": _native, "hf": _hf}[engine]
        run(model, prompts, 2)  # warm-up: first-call allocations and kernel choice
        runs[system] = (run, model)
    times: dict[str, list[float]] = {system: [] for system in systems}
    for _ in range(args.repeats):
        for system, (run, model) in runs.items():
            start = time.perf_counter()
            run(model, prompts, args.new_tokens)
            times[system].append(time.perf_counter() - start)
    return times


def _native(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> None:
    chunk = sample_chunk(model, prompts, new_tokens, stop_ids=[NEVER], pad_id=PAD)
    assert all(len(t) == new_tokens for t in chunk.tokens)


@torch.no_grad()
def _hf(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> None:
    ids = torch.tensor(prompts)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=PAD,
    )
    assert out.shape[1] == ids.shape[1] + new_tokens


@torch.no_grad()
def precision_gap(
    fp32: torch.nn.Module,
    int8: torch.nn.Module,
    prompts: list[list[int]],
    args: argparse.Namespace,
) -> dict:
    """|mu - log pi| over the int8 engine's sampled tokens, pi teacher-forced under fp32."""
    chunk = sample_chunk(int8, prompts, args.new_tokens, stop_ids=[NEVER], pad_id=PAD)
    tokens = torch.tensor([p + t for p, t in zip(prompts, chunk.tokens, strict=True)])
    logits = fp32(tokens).logits[:, args.prompt_len - 1 : -1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, args.prompt_len :, None])
    gap = (torch.tensor(chunk.logprobs) - logp.squeeze(-1)).abs()
    ratio = torch.exp(logp.squeeze(-1) - torch.tensor(chunk.logprobs))
    return {
        "mean_abs": float(gap.mean()),
        "max_abs": float(gap.max()),
        "ratio_mean": float(ratio.mean()),
    }


def train_runs(args: argparse.Namespace) -> dict:
    """The config trained with an fp32 and with an int8 generator: each run's warm-start steps,
    held-out curve, final accuracy and mean pi/mu ratio. The warm start's stopping rule reads the
    trainer's own policy, so both runs start RL from the same weights."""
    runs: dict[str, dict] = {}
    steps = [] if args.train_steps is None else [f"steps={args.train_steps}"]
    with tempfile.TemporaryDirectory(prefix="relayrl-generation-") as tmp:
        for precision in ("fp32", "int8"):
            overrides = [
                *args.overrides,
                *steps,
                f"generator.precision={precision}",
                "log.progress=false",
                "log.tensorboard=false",
                f"run.out_dir={tmp}",
            ]
            cfg = load_config(args.config, overrides)
            print(f"[{NAME}] training with generator.precision={precision}", file=sys.stderr)
            try:
                run = train_from(cfg, Path(tmp) / precision)
            finally:
                ray.shutdown()
            runs[precision] = run | {
                "final_accuracy_fp32": fp32_accuracy(cfg, Path(tmp) / precision / "checkpoint"),
                "steps": cfg.steps,
                "overrides": [relative(item) for item in overrides if "out_dir" not in item],
            }
    return runs


def fp32_accuracy(cfg: Config, checkpoint: Path) -> float:
    """Greedy held-out accuracy of a run's final (fp32-trained) checkpoint served in fp32: the
    policy the trainer learned, apart from the int8 generator's rounding."""
    served = load_config(
        None, [f"model.path={checkpoint}", "warm_start.max_steps=0", "generator.precision=fp32"]
    )
    served = served.model_copy(update={"task": cfg.task})
    return accuracy(Generator(served), Rewarder(served), "heldout")


def plot(result: dict, path: Path) -> Path:
    """Tokens/s against batch size, one line per system (log-log); held-out accuracy against
    step of the fp32 and int8 training runs."""
    panels = [part for part in ("throughput", "training") if result[part]]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    for ax, part in zip(axes[0], panels, strict=True):
        (_throughput_panel if part == "throughput" else _training_panel)(ax, result)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _throughput_panel(ax: plt.Axes, result: dict) -> None:
    """Tokens/s against batch size, one line per system."""
    for system, rows in result["throughput"].items():
        batches = [int(b) for b in rows]
        ax.plot(batches, [rows[b]["tokens_per_s"] for b in rows], marker="o", label=system)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (sequences)")
    ax.set_ylabel("generated tokens / s")
    s = result["settings"]
    ax.set_title(
        f"{s['model']['parameters'] / 1e6:.1f}M-param Llama, prompt {s['prompt_len']}, "
        f"{s['new_tokens']} new tokens, {s['threads']} threads",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def _training_panel(ax: plt.Axes, result: dict) -> None:
    """Held-out accuracy against RL step, one line per generator precision."""
    for precision, run in result["training"].items():
        steps, accuracy = zip(*run["eval_curve"], strict=True)
        ax.plot(steps, accuracy, marker="o", label=precision)
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out accuracy (greedy, exact answer)")
    ax.set_title("the default job, trained in full precision", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def markdown_table(result: dict) -> str:
    """Tokens/s per batch size and system, ratios to native-fp32, and the training runs."""
    systems = list(result["throughput"])
    lines = _throughput_rows(result, systems) if systems else []
    if result["training"]:
        if lines:
            lines.append("")
        lines += [
            "| generator.precision | warm-start steps | RL steps | held-out start | end "
            "| end, checkpoint in fp32 | mean pi/mu |"
        ]
        lines.append("|---|---|---|---|---|---|---|")
        for precision, run in result["training"].items():
            ratio = run["ratio_mean"]
            lines.append(
                f"| {precision} | {run.get('warm_start_steps', '-')} | {run['steps']} "
                f"| {run['start_accuracy']:.3f} "
                f"| {run['final_accuracy']:.3f} | {run['final_accuracy_fp32']:.3f} "
                f"| {'-' if ratio is None else f'{ratio:.4f}'} |"
            )
    m = result["machine"]
    lines += [
        "",
        f"Command: `{result['command']}`; {m['platform']}, {m['cpu_count']} CPUs, "
        f"torch {m['torch']}, transformers {m['transformers']}.",
    ]
    return "\n".join(lines)


def _throughput_rows(result: dict, systems: list[str]) -> list[str]:
    """The throughput table: tokens/s, ratios to native-fp32 and the int8 log-prob gap."""
    ratios = [s for s in systems if s != "native-fp32" and "native-fp32" in systems]
    gap = "int8 \\|mu - log pi\\|"  # pipes escaped for Markdown
    head = ["batch", *systems, *(f"{s} / native-fp32" for s in ratios), gap]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for batch in map(str, result["settings"]["batches"]):
        speed = {s: result["throughput"][s][batch]["tokens_per_s"] for s in systems}
        gap = result["int8_logprob_gap"][batch]
        cells = [batch, *(f"{speed[s]:.0f}" for s in systems)]
        cells += [f"{speed[s] / speed['native-fp32']:.2f}x" for s in ratios]
        cells.append(f"mean {gap['mean_abs']:.4f}, max {gap['max_abs']:.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
