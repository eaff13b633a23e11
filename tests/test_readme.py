"""The README stays true: its two set-up commands come first and exist, and
every configuration option (coordinator, scheduler, advisor, predictor) is documented."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from coordinator.settings import SECTIONS, _toml_value, options

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


def test_the_configuration_reference_gives_the_defaults_the_code_has():
    # a default changed in code and not in the README sends operators the wrong
    # way (round 18 moved advisor.release_variance 100 -> 25)
    wrong = []
    for section in SECTIONS:
        heading = re.search(r"^`\[" + section.name + r"\]` \(", README, re.M)
        assert heading, f"no reference table for [{section.name}]"
        table = README[heading.start():]
        table = table[: table.index("\n\n", table.index("|---"))]
        for opt in options(section):
            row = re.search(r"^\| `" + re.escape(opt.name) + r"` \| `([^`]*)` \|", table, re.M)
            documented = row.group(1) if row else None
            if documented != _toml_value(opt.default):
                wrong.append(f"{opt.key}: README {documented!r}, code {_toml_value(opt.default)!r}")
    assert not wrong, wrong


def test_the_configuration_reference_says_what_the_code_says():
    """Each option's meaning in the README tables is its help text in the code
    (which --print-config and systemd/coordinator.toml print), or a pointer to
    the option it shares one with ("(as `preemption`)"): two texts of one
    option drift apart (QA pass 23 found backfill_estimate_factor's)."""
    drifted = []
    for section in SECTIONS:
        heading = re.search(r"^`\[" + section.name + r"\]` \(", README, re.M)
        table = README[heading.start():]
        table = table[: table.index("\n\n", table.index("|---"))]
        for opt in options(section):
            row = re.search(r"^\| `" + re.escape(opt.name) + r"` \| `[^`]*` \| [^|]* \| (.*) \|$", table, re.M)
            text = row.group(1).replace("\\|", "|").strip() if row else None
            if text != opt.help.strip() and not (text and re.fullmatch(r"\(as `\w+`\)", text)):
                drifted.append(opt.key)
    assert not drifted, f"README meaning differs from the code's help text: {drifted}"


def test_ci_runs_the_readme_test_command():
    assert "scripts/test" in (ROOT / ".ci" / "run").read_text()
