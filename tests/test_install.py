"""``systemd/install.sh --root DIR`` (packaging) stages only what can move:
units, configuration and the entry-point links. It used to build the virtual
environment at DIR/opt/gpulb, whose entry points then began
``#!DIR/opt/gpulb/bin/python`` and whose pyvenv.cfg named the build host's
interpreter: the copied tree could not run on the target. Now the venv is
built where it runs (at /opt/gpulb, by a plain install on the host, or by the
commands the staging run prints for the target), and the closing lines name
the final paths only. Nothing here reaches the network: the staging run
installs no package, and the host's steps are looked at with --dry-run.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
SYSTEMD = ROOT / "systemd"
INSTALL = SYSTEMD / "install.sh"
CONFIG = ("coordinator.toml", "agent.toml", "coordinator.env", "agent.env")
UNITS = ("gpulb-coordinator.service", "gpulb-agent.service")
EXES = ("gpulb", "gpulb-coordinator", "gpulb-agent")


def _install(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(INSTALL), *args], capture_output=True, text=True, timeout=60)


def _steps(out: str) -> list[str]:
    return [line[2:] for line in out.splitlines() if line.startswith("+ ")]


def _notes(out: str) -> list[str]:
    return [line[2:] for line in out.splitlines() if line.startswith("# ")]


def _closing(out: str) -> list[str]:
    """The notes from "staged into" (or "installed. Next:") on: what the operator runs next."""
    notes = _notes(out)
    start = next(i for i, n in enumerate(notes) if n.startswith(("staged into", "installed. Next:")))
    return notes[start:]


def test_a_staging_root_gets_no_virtual_environment(tmp_path: Path) -> None:
    root = tmp_path / "stage"
    result = _install("--dry-run", "--root", str(root), "--source", "/src/gpulb")
    assert result.returncode == 0, result.stderr
    steps = _steps(result.stdout)
    assert not any("-m venv" in s or "pip install" in s or "set-search" in s for s in steps), steps
    assert not any(f"{root}/opt" in s for s in steps), steps  # nothing built under the staging root
    for exe in EXES:
        # the links name the final path, resolved once the target has the venv
        assert f"ln -sfn /opt/gpulb/bin/{exe} {root}/usr/local/bin/{exe}" in steps
    for f in CONFIG:
        assert any(s.startswith("install -m 06") and s.endswith(f"{SYSTEMD}/{f} {root}/etc/gpulb/{f}") for s in steps), f
    for unit in UNITS:
        assert f"install -m 0644 {SYSTEMD}/{unit} {root}/etc/systemd/system/{unit}" in steps
    assert not root.exists()  # --dry-run changes nothing


def test_the_staging_run_prints_the_targets_commands_with_final_paths(tmp_path: Path) -> None:
    root = tmp_path / "stage"
    result = _install("--dry-run", "--root", str(root), "--source", "/src/gpulb", "--python", "python3.11")
    assert result.returncode == 0, result.stderr
    closing = _closing(result.stdout)
    assert closing[0].startswith(f"staged into {root}")
    text = "\n".join(closing[1:])
    # the venv is built where it runs, by the commands the target host runs
    for command in (
        "python3.11 -m venv /opt/gpulb",
        "/opt/gpulb/bin/python -m pip install --upgrade /src/gpulb",
        "/opt/gpulb/bin/gpulb set-search build",
        "groupadd --system gpulb",
        "useradd --system --gid gpulb",
        "chgrp gpulb /etc/gpulb/coordinator.env /etc/gpulb/agent.env",
        "systemctl daemon-reload",
        "/opt/gpulb/bin/gpulb-agent --config /etc/gpulb/agent.toml --check",
        "/opt/gpulb/bin/gpulb-coordinator --config /etc/gpulb/coordinator.toml --print-config",
    ):
        assert command in text, (command, text)
    # after the "staged into" line, nothing names the staging root: the commands run on the target
    assert str(root) not in text, text
    # every absolute path the commands name is a final one
    paths = set(re.findall(r"(?<![\w.])/[\w./-]+", text))
    assert paths and all(p.startswith(("/opt/gpulb", "/etc/gpulb", "/src/gpulb", "/var/lib/gpulb", "/usr/sbin/nologin", "/dev/null"))
                         for p in paths), paths


def test_a_staging_run_writes_only_the_files_and_keeps_edits(tmp_path: Path) -> None:
    """A real run into a staging root (no root needed, no network: no pip)."""
    root = tmp_path / "stage"
    result = _install("--root", str(root), "--python", str(tmp_path / "no-such-python"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (root / "opt").exists()
    for exe in EXES:
        link = root / "usr/local/bin" / exe
        assert link.is_symlink() and os.readlink(link) == f"/opt/gpulb/bin/{exe}"
    for f in CONFIG:
        path = root / "etc/gpulb" / f
        assert path.read_bytes() == (SYSTEMD / f).read_bytes()
        assert stat.S_IMODE(path.stat().st_mode) == (0o640 if f.endswith(".env") else 0o644)
    for unit in UNITS:
        assert (root / "etc/systemd/system" / unit).read_bytes() == (SYSTEMD / unit).read_bytes()
    # what the units run is where the links point
    for unit in UNITS:
        execs = [line for line in (SYSTEMD / unit).read_text().splitlines() if line.startswith("ExecStart=")]
        assert execs and all("/usr/local/bin/gpulb-" in line for line in execs)
    # a second run keeps the operator's edits and replaces the units
    edited = root / "etc/gpulb/agent.toml"
    edited.write_text("[agent]\ncoordinator = \"c:50052\"\n")
    (root / "etc/systemd/system" / UNITS[0]).write_text("stale")
    again = _install("--root", str(root))
    assert again.returncode == 0, again.stderr
    assert f"# keeping {edited}" in again.stdout and edited.read_text().startswith("[agent]\ncoordinator")
    assert (root / "etc/systemd/system" / UNITS[0]).read_bytes() == (SYSTEMD / UNITS[0]).read_bytes()


def test_the_hosts_own_install_builds_the_venv_at_its_final_path() -> None:
    result = _install("--dry-run", "--source", "/src/gpulb")
    assert result.returncode == 0, result.stderr
    steps = _steps(result.stdout)
    venv_steps = [s for s in steps if "/opt/gpulb" in s and ("venv" in s or "pip" in s or "set-search" in s)]
    assert any(s.endswith("-m venv /opt/gpulb") for s in venv_steps) or "# virtual environment /opt/gpulb exists" in result.stdout
    pip = "/opt/gpulb/bin/python -m pip install --quiet --upgrade /src/gpulb"
    # the set search compiled ahead of time, right after the package (loads under W^X)
    assert steps[steps.index(pip) + 1] == "/opt/gpulb/bin/gpulb set-search build"
    closing = _closing(result.stdout)
    assert closing[0] == "installed. Next:"
    assert all("staged" not in n for n in _notes(result.stdout))
    text = "\n".join(closing)
    assert "--config /etc/gpulb/agent.toml --check" in text and "/etc/gpulb/coordinator.toml --print-config" in text


def test_help_describes_root_as_staging() -> None:
    result = _install("--help")
    assert result.returncode == 0
    assert "--root" in result.stdout and "target host" in result.stdout and "set -euo" not in result.stdout


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_install_script_passes_shellcheck() -> None:
    result = subprocess.run(["shellcheck", str(INSTALL)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout
