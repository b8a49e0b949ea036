"""The ``relayrl`` command: bad configs and bad data exit 2 with one line on stderr, before Ray is
imported.

A fresh interpreter pays the torch import that config validation needs (about 2 s): one bad
config, one bad data file, the import checks, the help texts and the console script run the real
entry point in fresh interpreters, all started at once; every other case calls ``cli.main`` in
this process, which is the same code after the interpreter starts.
"""

import os
import shutil
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import GOOD, write_jsonl, write_tokenizer

from relayrl import cli
from relayrl.config import load_config

REPO = Path(__file__).resolve().parents[1]
ARITH = "configs/arith.yaml"

# case id -> (arguments after `relayrl train`, text stderr must contain); {tmp} is a scratch folder.
BAD_CONFIGS = {
    "unknown-key": ([ARITH, "stepz=5"], "stepz: unknown key (allowed here: mode, steps"),
    "unknown-nested-key": ([ARITH, "trainer.los=aipo"], "trainer.los: unknown key"),
    "wrong-type": ([ARITH, "steps=abc"], "steps = 'abc': Input should be a valid integer"),
    "negative-staleness": ([ARITH, "max_staleness=-1"], "max_staleness = -1: "),
    "unknown-loss": (
        [ARITH, "trainer.loss=magic"],
        "allowed: aipo, aipo_clamp, ess_aipo, geo_mask, gipo",
    ),
    "unknown-advantage": ([ARITH, "trainer.advantage=ppo"], "trainer.advantage = 'ppo': "),
    "missing-file": (["configs/does_not_exist.yaml"], "'configs/does_not_exist.yaml' not found"),
    "missing-model-dir": ([ARITH, "model.path={tmp}/none"], "model.path = '{tmp}/none': "),
    "malformed-override": ([ARITH, "steps"], "override 'steps' must look like a.b=value"),
    "broken-yaml": (["{tmp}/broken.yaml"], "broken.yaml' is not readable YAML: "),
}

# case id -> (arguments after `relayrl train ARITH`, text stderr must contain), with the data files
# the `tmp` fixture writes.
DATASET = [ARITH, "task.name=dataset", "task.heldout_size=1"]
BAD_DATA = {
    "missing-data": (
        [*DATASET, "task.data={tmp}/none.jsonl"],
        "task.data = '{tmp}/none.jsonl': dataset file '{tmp}/none.jsonl' not found",
    ),
    "not-json": (
        [*DATASET, "task.data={tmp}/not_json.jsonl"],
        "{tmp}/not_json.jsonl line 3: not valid JSON (Expecting property name",
    ),
    "not-an-object": (
        [*DATASET, "task.data={tmp}/array.jsonl"],
        "{tmp}/array.jsonl line 2: an array, not a JSON object",
    ),
    "missing-prompt-field": (
        [*DATASET, "task.data={tmp}/good.jsonl", "task.prompt_field=question"],
        "task.prompt_field = 'question': {tmp}/good.jsonl line 1: no field 'question'; "
        "the row has: answer, prompt",
    ),
    "missing-answer-field": (
        [*DATASET, "task.data={tmp}/good.jsonl", "task.answer_field=solution"],
        "task.answer_field = 'solution': {tmp}/good.jsonl line 1: no field 'solution'",
    ),
    "template-field": (
        [*DATASET, "task.data={tmp}/good.jsonl", "task.template='{{prompt}} {{hint}}'"],
        "task.template = '{{prompt}} {{hint}}': {tmp}/good.jsonl line 1: the template names "
        "field 'hint'; the row has: answer, prompt",
    ),
    "answer-template-field": (
        [*DATASET, "task.data={tmp}/good.jsonl", "task.answer_template='#{{ans}}'"],
        "task.answer_template = '#{{ans}}': names field 'ans'",
    ),
    "letters-under-char": (
        [*DATASET, "task.data={tmp}/words.jsonl"],
        "model.tokenizer = 'builtin:char': cannot encode 4 characters of task.data = "
        "'{tmp}/words.jsonl' ('e', 'h', 'l', 'o'), found in 1 of 2 prompts and 0 of 2 "
        "warm-start targets; use model.tokenizer=builtin:byte (any UTF-8 text)",
    ),
    "addition-without-digits": (
        [ARITH, "model.tokenizer={tmp}/letters"],
        "model.tokenizer = '{tmp}/letters': cannot encode 10 characters of task.name = "
        "'addition' (a sample of 512)",
    ),
}

# Prints the exit code of a config error and which heavy modules it left imported (the
# controller must come after it), then the same for a data error (Ray and the controller come
# after it); one interpreter pays the torch import for both.
IMPORTS_AFTER_ERRORS = """
import sys
from relayrl.cli import main
code = main(["train", "configs/arith.yaml", "trainer.loss=magic"])
print(code, ",".join(m for m in ("ray", "relayrl.job", "transformers") if m in sys.modules))
code = main(["train", "configs/arith.yaml", "task.name=dataset", "task.data=none.jsonl"])
print(code, ",".join(m for m in ("ray", "relayrl.job") if m in sys.modules))
"""


# The cases that also run as a whole process (the others run in this one).
IN_A_PROCESS = ("unknown-key", "missing-data")


def run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cli")
    (folder / "broken.yaml").write_text("mode: sync\ntrainer: [loss,\n")
    write_jsonl(folder / "good.jsonl", GOOD)
    write_jsonl(folder / "not_json.jsonl", [*GOOD, "{not json"])
    write_jsonl(folder / "array.jsonl", [GOOD[0], "[1, 2]"])
    write_jsonl(folder / "words.jsonl", [{"prompt": "hello 1+1=", "answer": "2"}, GOOD[0]])
    write_tokenizer(folder / "letters", "abcdefghijklmnopqrstuvwxyz+=")
    return folder


@pytest.fixture(scope="module")
def runs(tmp) -> dict[str, subprocess.CompletedProcess]:
    relayrl = [sys.executable, "-m", "relayrl.cli"]
    commands = {name: [*relayrl, *_train_args(name, tmp)] for name in IN_A_PROCESS}
    commands["help"] = [*relayrl, "--help"]
    commands["train-help"] = [*relayrl, "train", "--help"]
    commands["imports"] = [sys.executable, "-c", IMPORTS_AFTER_ERRORS]
    script = Path(sys.executable).with_name("relayrl")
    if script.is_file():
        commands["console-script"] = [str(script), "train", "configs/does_not_exist.yaml"]
    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        futures = {name: pool.submit(run, argv) for name, argv in commands.items()}
        return {name: future.result() for name, future in futures.items()}


def _train_args(case: str, tmp: Path) -> list[str]:
    """``train ...`` for a case of BAD_CONFIGS or BAD_DATA (the latter with a run directory)."""
    if case in BAD_CONFIGS:
        args = BAD_CONFIGS[case][0]
    else:
        args = [*BAD_DATA[case][0], "--run-dir", f"{{tmp}}/run-{case}"]
    return ["train", *(arg.format(tmp=tmp) for arg in args)]


def _outcome(case: str, runs: dict, tmp: Path, capsys) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``relayrl train`` on a case: from its process, or from
    ``cli.main`` in this one."""
    if case in runs:
        return runs[case].returncode, runs[case].stdout, runs[case].stderr
    capsys.readouterr()
    code = cli.main(_train_args(case, tmp))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_exits_2_with_one_line_naming_the_field(case, runs, tmp, capsys):
    code, stdout, stderr = _outcome(case, runs, tmp, capsys)
    expected = BAD_CONFIGS[case][1].format(tmp=tmp)

    assert code == 2, stderr
    assert stdout == ""
    assert "Traceback" not in stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("relayrl: config error: ")
    assert expected in lines[0]


def test_config_error_exits_before_ray_and_the_controller_are_imported(runs):
    result = runs["imports"]

    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].strip() == "2"
    assert result.stderr.startswith("relayrl: config error: trainer.loss = 'magic'")


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data_exits_2_with_one_line_before_the_run_starts(case, runs, tmp, capsys):
    code, stdout, stderr = _outcome(case, runs, tmp, capsys)
    expected = BAD_DATA[case][1].format(tmp=tmp)

    assert code == 2, stderr
    assert stdout == ""
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("relayrl: data error: ")
    assert expected in lines[0]
    # The controller makes the run directory before it starts Ray: the run never began.
    assert not (tmp / f"run-{case}").exists()


def test_data_error_exits_before_ray_and_the_controller_are_imported(runs):
    result = runs["imports"]

    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1].strip() == "2"
    assert result.stderr.splitlines()[1].startswith("relayrl: data error: task.data = 'none.jsonl'")


def test_help_shows_the_train_command_and_overrides(runs):
    result = runs["help"]

    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: relayrl")
    assert "train" in result.stdout
    assert "Overrides use dotted keys" in result.stdout
    assert "--ray-address auto" in result.stdout


def test_train_help_shows_overrides_and_ray_address(runs):
    result = runs["train-help"]

    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: relayrl train")
    for text in ("config", "overrides", "a.b=value overrides", "--ray-address", "--run-dir"):
        assert text in result.stdout


def test_installed_console_script_exits_2_on_a_config_error(runs):
    if "console-script" not in runs:
        pytest.skip("relayrl console script not installed next to this interpreter")
    result = runs["console-script"]

    assert result.returncode == 2
    assert result.stderr.startswith("relayrl: config error: config file ")
    assert len(result.stderr.splitlines()) == 1


@pytest.fixture
def trained(monkeypatch) -> list:
    """Stands in for relayrl.job so main() can run to the end without training."""
    calls = []
    controller = types.ModuleType("relayrl.job")
    controller.train = lambda cfg, run_dir, resume=False: calls.append((cfg, run_dir))
    monkeypatch.setitem(sys.modules, "relayrl.job", controller)
    return calls


def test_train_hands_the_validated_config_and_run_dir_to_the_controller(trained, tmp_path):
    code = cli.main(
        ["train", str(REPO / ARITH), "mode=sync", "--ray-address", "auto", "steps=7"]
        + ["--run-dir", str(tmp_path / "run")]
    )

    assert code == 0
    ((cfg, run_dir),) = trained
    assert cfg == load_config(REPO / ARITH, ["mode=sync", "steps=7", "ray.address=auto"])
    assert run_dir == tmp_path / "run"


def test_ray_address_option_wins_over_an_override(trained, tmp_path):
    # run.out_dir: the CLI now claims (creates) the run directory before training starts
    args = ["ray.address=other", f"run.out_dir={tmp_path}", "--ray-address", "auto"]
    cli.main(["train", str(REPO / ARITH), *args])

    assert trained[0][0].ray.address == "auto"


def test_run_dir_defaults_to_out_dir_name_and_time(trained, tmp_path):
    cli.main(["train", str(REPO / ARITH), f"run.out_dir={tmp_path}", "run.name=smoke"])

    run_dir = trained[0][1]
    assert run_dir.parent == tmp_path
    assert run_dir.name.startswith("smoke-")


def test_config_error_in_process_returns_2_without_training(trained, capsys):
    code = cli.main(["train", str(REPO / ARITH), "max_staleness=-1"])

    assert code == 2
    assert trained == []
    err = capsys.readouterr().err
    assert err.startswith("relayrl: config error: max_staleness = -1: ")
    assert err.count("\n") == 1


def test_unknown_option_is_a_usage_error(trained, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["train", str(REPO / ARITH), "--bogus", "x"])

    assert info.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    assert trained == []


def test_a_run_dir_holding_files_is_refused_unless_overwrite(tmp_path):
    from relayrl.cli import _claim_run_dir

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "summary.json").write_text("{}")
    with pytest.raises(FileExistsError, match="--overwrite"):
        _claim_run_dir(str(taken), False, "runs", "x")
    assert _claim_run_dir(str(taken), True, "runs", "x") == taken
    assert list(taken.iterdir()) == []  # emptied: nothing of the earlier run mixes in


def test_two_runs_started_in_the_same_second_get_two_directories(tmp_path):
    from relayrl.cli import _claim_run_dir

    first = _claim_run_dir(None, False, str(tmp_path), "arith")
    second = _claim_run_dir(None, False, str(tmp_path), "arith")
    assert first != second and first.is_dir() and second.is_dir()


def test_the_cli_refuses_an_earlier_runs_directory_at_once(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    result = run([sys.executable, "-m", "relayrl.cli", "train", ARITH, f"--run-dir={tmp_path}"])
    assert result.returncode == 2
    assert "holds an earlier run's files; pass --overwrite" in result.stderr


def _run_with_a_checkpoint(tmp_path):
    """A run directory with a config and one (tiny, valid) run checkpoint."""
    from relayrl.checkpoint_format import commit, save_part, staging
    from relayrl.config import save_config

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_config(load_config(REPO / ARITH, ["steps=20"]), run_dir / "config.yaml")
    commit(staging(run_dir, 4), 4, [save_part(staging(run_dir, 4), "controller", {})], keep=2)
    return run_dir


def test_resume_continues_with_the_runs_own_config_and_allowed_overrides(monkeypatch, tmp_path):
    calls = []
    controller = types.ModuleType("relayrl.job")
    controller.train = lambda cfg, run_dir, resume=False: calls.append((cfg, run_dir, resume))
    monkeypatch.setitem(sys.modules, "relayrl.job", controller)
    run_dir = _run_with_a_checkpoint(tmp_path)

    assert cli.main(["train", "--resume", str(run_dir), "steps=30", "log.every=5"]) == 0
    ((cfg, where, resume),) = calls
    assert (where, resume, cfg.steps, cfg.log.every) == (run_dir, True, 30, 5)
    assert cfg.task == load_config(REPO / ARITH).task


def test_resume_refuses_an_override_that_would_not_match_the_checkpoint(tmp_path, capsys):
    run_dir = _run_with_a_checkpoint(tmp_path)
    assert cli.main(["train", "--resume", str(run_dir), "model.hidden_size=64"]) == 2
    err = capsys.readouterr().err
    assert "model.hidden_size=64" in err and "may not change" in err


def test_resume_of_a_directory_without_a_checkpoint_exits_2_and_says_so(tmp_path, capsys):
    run_dir = _run_with_a_checkpoint(tmp_path)
    shutil.rmtree(run_dir / "checkpoints")
    assert cli.main(["train", "--resume", str(run_dir)]) == 2
    assert "no usable checkpoint" in capsys.readouterr().err
    assert cli.main(["train", "--resume", str(tmp_path / "nowhere")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_sigint_and_sigterm_stop_a_run_through_one_handler():
    import signal

    before = {s: signal.getsignal(s) for s in cli.STOP_SIGNALS}
    try:
        cli.install_stop_handlers()
        handlers = {signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        assert handlers == {cli._interrupt}
        # Outside a run's loop there is no step to finish: the signal stops at once.
        with pytest.raises(KeyboardInterrupt):
            cli._interrupt(signal.SIGTERM, None)
    finally:
        for s, h in before.items():
            signal.signal(s, h)
