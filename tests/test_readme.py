"""The README stays true: its two set-up commands come first and exist, and
every configuration option (coordinator, scheduler, advisor, predictor) is documented."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from coordinator.settings import SECTIONS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_the_two_commands_come_first_and_are_executable():
    first_block = README.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split()[0] for line in first_block.strip().splitlines()]
    assert commands == ["scripts/demo", "scripts/test"]
    for command in commands:
        path = ROOT / command
        assert path.exists() and os.access(path, os.X_OK), command


def test_every_option_is_in_the_configuration_reference():
    missing = [
        f"{section.name}.{f.name}"
        for section in SECTIONS
        for f in dataclasses.fields(section.cls)
        if f"`{f.name}`" not in README
    ]
    assert {s.name for s in SECTIONS} >= {"coordinator", "scheduler", "advisor", "predictor"}
    for section in SECTIONS:
        assert f"`[{section.name}]`" in README, f"no reference table for [{section.name}]"
    assert not missing, f"undocumented options: {missing}"


def test_ci_runs_the_readme_test_command():
    assert "scripts/test" in (ROOT / ".ci" / "run").read_text()
