"""Every option a run's config accepts is read: a 2-step arith run and a 2-step babyai run through
``relayrl train``, with each read of a config option recorded in the driver and in every actor
the config reaches.

A config is tracked by swapping the class of it and of each of its sections for a subclass whose
``__getattribute__`` appends ``section.option`` and its process id to a log file (once per
process and option); a pickled copy is rebuilt as a tracked one in the actor that unpickles it.
``model_dump`` of a section reads the options it returns (``vla_config`` builds the policy's
sizes so); a dump of the whole config, which the run only logs, reads none. What counts as
accepted is what the run's saved ``config.yaml`` holds (the present sections, the chosen loss's
options, the options of settings that hold): ``save_config`` writes exactly what a run may read,
and its own reads (of the settings that decide that) do not count.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import QUIET, SMALL_EMBODIED, SMALL_LLM, TINY, check_books
from pydantic import BaseModel

from relayrl import cli
from relayrl.config import Config, load_config, save_config

REPO = Path(__file__).resolve().parents[1]
SAVE_CONFIG = save_config.__code__
# An option no run of the test session can read: Ray is up before the run starts it.
SESSION_RAY = {"ray.num_cpus"}


def _saving() -> bool:
    """Whether ``save_config`` is on the stack: its reads decide what it writes."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is SAVE_CONFIG:
            return True
        frame = frame.f_back
    return False


def _tracked_class(base: type[BaseModel], prefix: str, log: str) -> type[BaseModel]:
    """A subclass of ``base`` whose option reads go to the file ``log`` as ``prefix + name``."""
    options = set(base.model_fields)
    seen: set[str] = set()

    def record(names: set[str]) -> None:
        new = names - seen
        if new and not _saving():
            seen.update(new)
            with open(log, "a") as f:
                f.write("".join(f"{prefix}{name} {os.getpid()}\n" for name in sorted(new)))

    def __getattribute__(self: Any, name: str) -> Any:
        if name in options and name not in seen:
            record({name})
        return object.__getattribute__(self, name)

    def model_dump(self: Any, **kwargs: Any) -> dict[str, Any]:
        dumped = base.model_dump(self, **kwargs)
        if prefix:
            record(set(dumped) & options)
        return dumped

    def __reduce__(self: Any) -> tuple:
        return _rebuild, (base, prefix, log, self.__getstate__())

    namespace = {
        "__getattribute__": __getattribute__,
        "__reduce__": __reduce__,
        "model_dump": model_dump,
    }
    return type(f"Tracked{base.__name__}", (base,), namespace)


def _rebuild(base: type[BaseModel], prefix: str, log: str, state: dict) -> BaseModel:
    """A tracked section from its pickled state (what unpickling runs in an actor)."""
    section = object.__new__(_tracked_class(base, prefix, log))
    section.__setstate__(state)
    return section


def tracked(section: BaseModel, log: Path, prefix: str = "") -> BaseModel:
    """``section`` and every section in it, their class swapped for one that logs option reads."""
    for name, value in section.__dict__.items():
        if isinstance(value, BaseModel):
            tracked(value, log, f"{prefix}{name}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    tracked(item, log, f"{prefix}{name}[{i}].")
    object.__setattr__(section, "__class__", _tracked_class(type(section), prefix, str(log)))
    return section


def accepted(tree: dict, section: BaseModel, prefix: str = "") -> set[str]:
    """The options a saved config holds, by dotted key (a section's whole value is not one)."""
    keys = set()
    for name, value in tree.items():
        inner = object.__getattribute__(section, name)
        if isinstance(inner, BaseModel):
            keys |= accepted(value, inner, f"{prefix}{name}.")
        elif isinstance(inner, list) and inner and isinstance(inner[0], BaseModel):
            for i, item in enumerate(inner):
                keys |= accepted(value[i], item, f"{prefix}{name}[{i}].")
        else:
            keys.add(prefix + name)
    return keys


def unread(config: Path, overrides: list[str], tmp_path: Path, monkeypatch) -> tuple[dict, set]:
    """Run ``relayrl train CONFIG OVERRIDES`` with its option reads tracked; its summary and the
    options its saved config holds that nothing read."""
    log = tmp_path / "reads.txt"
    log.touch()
    made: list[Config] = []

    def load_tracked(*args: Any, **kwargs: Any) -> Config:
        made.append(load_config(*args, **kwargs))
        return tracked(made[-1].model_copy(deep=True), log)

    monkeypatch.setattr(cli, "load_config", load_tracked)
    out = tmp_path / "runs"
    assert cli.main(["train", str(config), *overrides, f"run.out_dir={out}"]) == 0
    (run_dir,) = out.iterdir()
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    reads = [line.split() for line in log.read_text().splitlines()]
    assert len({pid for _, pid in reads}) > 2  # the driver's reads and its actors'
    return summary, accepted(saved, made[0]) - {key for key, _ in reads} - SESSION_RAY


@pytest.fixture
def by_value(ray_session):
    """Actors unpickle the tracked classes from this module, which they cannot import."""
    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield ray_session
    ray_session.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


# Both runs write a checkpoint after each step, so that the checkpoint options have a reader.
TRACKED = ["steps=2", "run.checkpoint_every=1"]


def test_a_two_step_arith_run_reads_every_option_it_accepts(by_value, tmp_path, monkeypatch):
    overrides = [*TINY, *SMALL_LLM, *TRACKED]
    summary, missed = unread(REPO / "configs" / "arith.yaml", overrides, tmp_path, monkeypatch)
    assert summary["status"] == "finished" and summary["steps"] == 2
    assert not missed, f"accepted and never read: {', '.join(sorted(missed))}"


def test_a_two_step_babyai_run_reads_every_option_it_accepts(by_value, tmp_path, monkeypatch):
    overrides = [*QUIET, *SMALL_EMBODIED, *TRACKED]
    summary, missed = unread(REPO / "configs" / "babyai.yaml", overrides, tmp_path, monkeypatch)
    assert summary["status"] == "finished" and summary["steps"] == 2
    check_books(summary)
    assert not missed, f"accepted and never read: {', '.join(sorted(missed))}"
