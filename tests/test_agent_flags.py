"""``gpulb-agent`` refuses numbers out of range, as flags and as ``--config``
options, with one line naming the flag or option and the range, and exit
status 2: no traceback, and nothing started."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agent import main as agent_main

pytestmark = pytest.mark.timeout(60)


def _exit(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        agent_main.main(["--backend", "sim", "--coordinator", "127.0.0.1:1", *argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return info.value.code, err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--sim-gpus", "0"], "argument --sim-gpus: must be an integer in 1..64, got 0"),
        (["--sim-gpus", "-3"], "argument --sim-gpus: must be an integer in 1..64, got -3"),
        (["--sim-gpus", "65"], "argument --sim-gpus: must be an integer in 1..64"),
        (["--sim-gpus", "two"], "argument --sim-gpus: must be an integer in 1..64, got 'two'"),
        (["--sim-seed", "1.5"], "argument --sim-seed: must be an integer, got '1.5'"),
        (["--interval-min", "0"], "argument --interval-min: must be a number in 0.01..60, got 0.0"),
        (["--interval-min", "nan"], "argument --interval-min: must be a number in 0.01..60, got nan"),
        (["--interval-min", "-1"], "argument --interval-min: must be a number in 0.01..60"),
        (["--interval-max", "inf"], "argument --interval-max: must be a number in 0.01..60, got inf"),
        (["--interval-max", "61"], "argument --interval-max: must be a number in 0.01..60"),
        (["--interval-min", "5", "--interval-max", "1"], "--interval-min (5 s) is above --interval-max (1 s)"),
        (["--interval-min", "3"], "--interval-min (3 s) is above the default interval_max 2 s"),
        (["--outage-buffer", "-1"], "argument --outage-buffer: must be an integer in 1..1000000, got -1"),
        (["--outage-buffer", "0"], "argument --outage-buffer: must be an integer in 1..1000000, got 0"),
        (["--check", "--check-rounds", "x"], "argument --check-rounds: must be an integer >= 1, got 'x'"),
        (["--check", "--check-rounds", "0"], "argument --check-rounds: must be an integer >= 1, got 0"),
        (["--check", "--check-rounds", "-2", "--json"], "argument --check-rounds: must be an integer >= 1, got -2"),
        # node ids the coordinator refuses at registration: exit 78 after connecting, before
        (["--node-id", "gpu node 1"], "argument --node-id: 'gpu node 1' is not a node id the coordinator accepts: "
                                      "it must be 1-128 of [A-Za-z0-9._-], starting alphanumeric"),
        (["--node-id=-gpu1"], "argument --node-id: '-gpu1' is not a node id"),
        (["--node-id", "n" * 129], "argument --node-id: 'nnn"),
        (["--node-id", ""], "argument --node-id: '' is not a node id"),
        (["--check", "--node-id", "gpu/1"], "argument --node-id: 'gpu/1' is not a node id"),
    ],
)
def test_a_bad_flag_exits_2_naming_the_flag_and_range(argv, needle, capsys):
    code, err = _exit(argv, capsys)
    assert code == 2 and needle in err, err


@pytest.mark.parametrize(
    "toml, needle",
    [
        ("sim_gpus = 0", "option 'sim_gpus' must be an integer in 1..64, got 0"),
        ("sim_gpus = 2.5", "option 'sim_gpus' must be an integer in 1..64, got 2.5"),
        ("sim_seed = \"7\"", "option 'sim_seed' must be an integer, got '7'"),
        ("interval_min = nan", "option 'interval_min' must be a number in 0.01..60, got nan"),
        ("interval_max = \"2\"", "option 'interval_max' must be a number in 0.01..60, got '2'"),
        ("interval_min = 3.0", "interval_min in {path} (3 s) is above the default interval_max 2 s"),
        ("outage_buffer = -1", "option 'outage_buffer' must be an integer in 1..1000000, got -1"),
        ("outage_buffer = true", "option 'outage_buffer' must be an integer in 1..1000000, got True"),
        ("backend = \"nvlm\"", "option 'backend' must be one of nvml, sim, auto, got 'nvlm'"),
        ("log_level = \"loud\"", "option 'log_level' must be one of"),
        ("node_id = 7", "option 'node_id' must be a string, got 7"),
        ("node_id = \"rack 4/gpu-01\"", "option 'node_id' 'rack 4/gpu-01' is not a node id the coordinator accepts: "
                                       "it must be 1-128 of [A-Za-z0-9._-], starting alphanumeric"),
        ("[agent.labels]\nrack = 1", "[agent.labels] must map names to strings"),
        ("sim_gpu = 2", "unknown option 'sim_gpu'"),
        ("sim_gpus = ", "--config {path}:"),  # not TOML
    ],
)
def test_a_bad_config_option_exits_2_naming_the_option(toml, needle, tmp_path, capsys):
    path = tmp_path / "agent.toml"
    path.write_text(f"[agent]\n{toml}\n")
    code, err = _exit(["--config", str(path)], capsys)
    assert code == 2 and needle.format(path=path) in err and str(path) in err, err


def test_a_flag_overrides_the_file_and_the_pair_is_checked_after_both(tmp_path, capsys):
    path = tmp_path / "agent.toml"
    path.write_text("[agent]\ninterval_min = 3.0\n")
    settings = agent_main._settings(agent_main.parse_args(["--config", str(path), "--interval-max", "4"]))
    assert (settings["interval_min"], settings["interval_max"]) == (3.0, 4.0)
    code, err = _exit(["--config", str(path), "--interval-max", "1"], capsys)
    assert code == 2 and f"interval_min in {path} (3 s) is above --interval-max (1 s)" in err, err


def test_a_missing_config_file_exits_2(tmp_path, capsys):
    code, err = _exit(["--config", str(tmp_path / "nope.toml")], capsys)
    assert code == 2 and "nope.toml" in err


def test_in_range_values_are_taken():
    settings = agent_main._settings(agent_main.parse_args(
        ["--sim-gpus", "64", "--sim-seed", "-5", "--interval-min", "0.01", "--interval-max", "60", "--outage-buffer", "1"]))
    assert (settings["sim_gpus"], settings["sim_seed"], settings["interval_min"], settings["interval_max"], settings["outage_buffer"]) == (
        64, -5, 0.01, 60.0, 1)


def test_node_ids_are_checked_by_the_coordinators_rule(monkeypatch, capsys):
    """What the coordinator registers is taken; a hostname it would refuse
    (the default node id) is named as such, with the flag and option to set."""
    for node_id in ("gpu-01.rack_4", "7", "n" * 128):
        assert agent_main._settings(agent_main.parse_args(["--node-id", node_id]))["node_id"] == node_id
    monkeypatch.setattr(agent_main.socket, "gethostname", lambda: "_build host")
    code, err = _exit([], capsys)
    assert code == 2 and ("the hostname '_build host' (node_id's default) is not a node id the coordinator accepts: "
                          "it must be 1-128 of [A-Za-z0-9._-], starting alphanumeric; give one with --node-id or "
                          "node_id in --config") in err, err


def test_check_rounds_0_is_a_usage_error_like_any_bad_flag(capsys):
    """`--check --check-rounds 0` printed a bare "--check-rounds must be >= 1,
    got 0" (no program name, no usage line), --json or not: now argparse's
    error and exit 2, as for any other bad flag."""
    for extra in ([], ["--json"]):
        code, err = _exit(["--check", "--no-coordinator", "--check-rounds", "0", *extra], capsys)
        assert code == 2 and err.startswith("usage: gpulb-agent"), err
        assert err.rstrip().endswith("gpulb-agent: error: argument --check-rounds: must be an integer >= 1, got 0"), err


def test_every_flag_says_what_it_does():
    """--json, --log-level and --log-format had no help text."""
    undocumented = [a.option_strings for a in agent_main.build_parser()._actions if not a.help]
    assert undocumented == [], undocumented


def test_help_documents_the_exit_status():
    out = subprocess.run([sys.executable, "-m", "agent.main", "--help"], capture_output=True, text=True, timeout=30)
    text = " ".join(out.stdout.split())
    assert out.returncode == 0
    assert "78 the coordinator refused the registration" in text and "RestartPreventExitStatus=78" in text
    assert "ALREADY_EXISTS" in text


def test_the_command_line_exits_2_without_a_traceback():
    out = subprocess.run([sys.executable, "-m", "agent.main", "--backend", "sim", "--sim-gpus", "0"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "--sim-gpus" in out.stderr and "Traceback" not in out.stderr, out.stderr
