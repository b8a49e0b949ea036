"""`relayrl eval`: score an LLM checkpoint on MATH-500, GSM8K or a user dataset, or replay a
run's own evaluation on its saved checkpoint.

With ``--data``: completions come from the generator executor, scores from the rewarder executor
with the math scorer (sandboxed), both run in this process. Reports pass@1 (first sample), mean@k
(mean accuracy over the k samples of each problem), pass@k (any of the k correct), a breakdown by
subject and level where the data has them, and timing; writes one JSONL line per sample.

Without, on an LLM run directory (``evaluate_run``): the run's evaluation protocol
(``relayrl.executors.evaluator``: greedy completions of its task's held-out split, scored by its
rewarder), played by the same executors with the run's config on ``RUN_DIR/checkpoint``: the
numbers of the run's final evaluation.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from relayrl.config import Config, load_config
from relayrl.data.datasets import DATASETS, Example, load_examples
from relayrl.executors.evaluator import heldout_result
from relayrl.executors.generator import Generator
from relayrl.executors.rewarder import Rewarder
from relayrl.rewards.math import extract_answer


def checkpoint_dir(path: Path) -> Path:
    """A Hugging Face checkpoint directory, given it or a run directory that holds one."""
    for candidate in (path, path / "checkpoint"):
        if (candidate / "config.json").is_file():
            return candidate
    raise FileNotFoundError(f"'{path}' is neither a checkpoint directory nor a run directory")


def llm_run(path: Path) -> tuple[Config, Path] | None:
    """The config and checkpoint folder of an LLM run directory (or of the checkpoint folder
    inside one); None when ``path`` is not one."""
    for run_dir, ckpt in ((path, path / "checkpoint"), (path.parent, path)):
        if (run_dir / "config.yaml").is_file() and (ckpt / "config.json").is_file():
            cfg = load_config(run_dir / "config.yaml", [])
            if cfg.workload == "llm":
                return cfg, ckpt
    return None


def evaluate_run(cfg: Config, checkpoint: Path) -> dict:
    """The run's evaluation protocol on the policy in ``checkpoint``: held-out accuracy,
    overall and per task, as the run's in-run evaluations report it."""
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(checkpoint)})})
    start = time.time()
    generator, rewarder = Generator(cfg), Rewarder(cfg)
    try:
        summary, _ = rewarder.score(generator.evaluate("heldout"))
    finally:
        rewarder.close()
    found = heldout_result(cfg.task.name, summary, None, time.time() - start)
    return found | {"checkpoint": str(checkpoint), "task": cfg.task.name}


def format_run_report(report: dict) -> str:
    """``evaluate_run``'s report as a few lines."""
    return "\n".join(
        [
            f"held-out {report['task']}: {report['n']} problems, greedy, checkpoint "
            f"{report['checkpoint']}",
            f"accuracy {report['accuracy']:.3f} ({report['time_s']:.1f} s)",
        ]
    )


def load_data(data: str, limit: int | None) -> list[Example]:
    """``math500``, ``gsm8k`` or a JSONL/Parquet path with ``prompt`` and ``answer`` fields."""
    examples = DATASETS[data]() if data in DATASETS else load_examples(data)
    return examples[:limit] if limit else examples


def evaluate(
    path: Path,
    data: str,
    *,
    k: int = 1,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    limit: int | None = None,
    out: Path | None = None,
    workers: int = 2,
    chat_template: bool = False,
) -> dict:
    """Generate, score and report; returns the report and writes the per-sample JSONL."""
    ckpt = checkpoint_dir(path)
    examples = load_data(data, limit)
    cfg = load_config(
        None,
        [
            f"model.path={ckpt}",
            f"model.tokenizer={ckpt}",
            f"generator.temperature={temperature}",
            "rewarder.scorer=math",
            f"rewarder.workers={workers}",
            f"task.chat_template={str(chat_template).lower()}",
        ],
    )
    generator, rewarder = Generator(cfg), Rewarder(cfg)
    try:
        encoded = [generator.codec.encode_lenient(e.prompt) for e in examples]
        start = time.perf_counter()
        batch = generator.complete(
            [ids for ids, _ in encoded],
            [e.answer for e in examples],
            k=k,
            greedy=k == 1,
            max_new_tokens=max_new_tokens,
        )
        generate_s = time.perf_counter() - start
        start = time.perf_counter()
        summary, scored = rewarder.score(batch)
        score_s = time.perf_counter() - start
    finally:
        rewarder.close()
    scores = scored.rewards.reshape(len(examples), k)
    report = {
        "checkpoint": str(ckpt),
        "data": data,
        "problems": len(examples),
        "k": k,
        "pass@1": float(scores[:, 0].mean()) if len(examples) else 0.0,
        f"mean@{k}": float(scores.mean()) if len(examples) else 0.0,
        f"pass@{k}": float((scores > 0).any(axis=1).mean()) if len(examples) else 0.0,
        "by": _breakdown(examples, scores),
        "timing_s": {"generate": generate_s, "score": score_s},
        "score_timeouts": summary["timeouts"],
        "score_errors": summary["errors"],
        "dropped_prompt_chars": sum(dropped for _, dropped in encoded),
    }
    out = out or ckpt.parent / f"eval_{Path(data).stem}.jsonl"
    with out.open("w") as file:
        for i, example in enumerate(examples):
            for j in range(k):
                text = scored.completions[i * k + j]
                row = {"problem": example.prompt, "answer": example.answer, "sample": j}
                row |= {"response": text, "extracted": extract_answer(text)}
                row |= {"score": float(scores[i, j]), **example.meta}
                file.write(json.dumps(row) + "\n")
    report["samples_file"] = str(out)
    return report


def _breakdown(examples: list[Example], scores: np.ndarray) -> dict:
    by: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for example, row in zip(examples, scores, strict=True):
        for key in ("subject", "level"):
            if key in example.meta:
                by[key][str(example.meta[key])].append(float(row.mean()))
    return {key: {v: float(np.mean(s)) for v, s in sorted(g.items())} for key, g in by.items()}


def format_report(report: dict) -> str:
    """The report as a few human-readable lines."""
    k = report["k"]
    lines = [
        f"{report['data']}: {report['problems']} problems, k={k}, "
        f"checkpoint {report['checkpoint']}",
        f"pass@1 {report['pass@1']:.3f}"
        + (
            f"   mean@{k} {report[f'mean@{k}']:.3f}   pass@{k} {report[f'pass@{k}']:.3f}"
            if k > 1
            else ""
        ),
    ]
    for key, groups in report["by"].items():
        lines.append(f"by {key}: " + ", ".join(f"{g} {acc:.3f}" for g, acc in groups.items()))
    t = report["timing_s"]
    lines.append(
        f"generate {t['generate']:.1f} s, score {t['score']:.1f} s; "
        f"score timeouts {report['score_timeouts']}, errors {report['score_errors']}"
    )
    if report["dropped_prompt_chars"]:
        lines.append(
            f"note: {report['dropped_prompt_chars']} prompt characters are not in this "
            "checkpoint's vocabulary and were dropped"
        )
    lines.append(f"samples written to {report['samples_file']}")
    return "\n".join(lines)
