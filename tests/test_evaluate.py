"""`relayrl eval` on tiny Hugging Face checkpoints made here, with a user file and MATH-500: the
first as a command in its own process, the others through ``cli.main`` in this one (the same code
once the interpreter has started, without paying the torch import again)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import tiny_config

from relayrl import cli
from relayrl.models.lm import build_policy, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def _checkpoint(folder: Path, tokenizer: str) -> Path:
    cfg = tiny_config(f"model.tokenizer={tokenizer}")
    tok = load_tokenizer(tokenizer)
    build_policy(cfg.model, tok, seed=0).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "eval", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_eval_of_a_byte_tokenizer_checkpoint_on_a_user_file(tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpt", "builtin:byte")
    data = tmp_path / "mine.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(3))
    )
    out = tmp_path / "samples.jsonl"
    result = _eval(
        str(ckpt),
        "--data",
        str(data),
        "--k",
        "2",
        "--max-new-tokens",
        "4",
        "--workers",
        "1",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "pass@1" in result.stdout and "mean@2" in result.stdout and "pass@2" in result.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and {r["sample"] for r in rows} == {0, 1}
    assert {"problem", "answer", "response", "extracted", "score"} <= set(rows[0])
    assert all(r["score"] in (0.0, 1.0) for r in rows)


def test_eval_of_a_run_directory_with_the_demo_char_tokenizer_on_math500(
    tmp_path, monkeypatch, capsys
):
    _checkpoint(tmp_path / "run" / "checkpoint", "builtin:char")
    monkeypatch.chdir(tmp_path)  # no ../shared/data beside it
    monkeypatch.delenv("RELAYRL_DATA_DIR", raising=False)  # MATH-500 ships with the package
    capsys.readouterr()
    argv = ["eval", str(tmp_path / "run"), "--data", "math500", "--limit", "5"]
    code = cli.main([*argv, "--max-new-tokens", "8", "--workers", "1"])
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    assert "by subject:" in out and "by level:" in out
    assert "prompt characters are not in this checkpoint's vocabulary" in out
    rows = (tmp_path / "run" / "eval_math500.jsonl").read_text().splitlines()
    assert len(rows) == 5 and "subject" in json.loads(rows[0])


def test_eval_of_a_missing_checkpoint_exits_2(tmp_path, capsys):
    capsys.readouterr()
    code = cli.main(["eval", str(tmp_path), "--data", "math500"])
    assert code == 2 and "neither a checkpoint directory" in capsys.readouterr().err
