"""The README stays true: its two set-up commands come first and exist, and
every configuration option of the coordinator and scheduler is documented."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from coordinator.config import CoordinatorConfig
from scheduler.config import SchedulerConfig

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
        f"{section}.{f.name}"
        for section, cls in (("coordinator", CoordinatorConfig), ("scheduler", SchedulerConfig))
        for f in dataclasses.fields(cls)
        if f"`{f.name}`" not in README
    ]
    assert not missing, f"undocumented options: {missing}"


def test_ci_runs_the_readme_test_command():
    assert "scripts/test" in (ROOT / ".ci" / "run").read_text()
