"""The README's config reference and commands stay true to the code."""

from __future__ import annotations

import re
from pathlib import Path

from relayrl.config import reference_markdown

ROOT = Path(__file__).resolve().parents[1]


def test_readme_config_reference_is_generated_from_the_config_models():
    readme = (ROOT / "README.md").read_text()
    block = re.search(
        r"<!-- config-reference:start -->\n(.*)<!-- config-reference:end -->", readme, re.S
    )
    assert block, "README lacks the config-reference markers"
    assert block.group(1) == reference_markdown(), (
        "README config reference is stale: regenerate it with "
        "python -c 'from relayrl.config import reference_markdown; print(reference_markdown())'"
    )


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = [line for line in readme.splitlines() if "pytest" in line][0].strip()
    assert test_command in ci
