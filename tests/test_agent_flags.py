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
    got 0" (no program name), --json or not: now the error line of any other
    bad flag, and exit 2."""
    for extra in ([], ["--json"]):
        code, err = _exit(["--check", "--no-coordinator", "--check-rounds", "0", *extra], capsys)
        assert code == 2 and err.startswith("gpulb-agent: error: argument --check-rounds: must be an integer >= 1, got 0"), err


@pytest.mark.parametrize("argv", [["--sim-gpus", "0"], ["--bogus"], ["--backend", "cuda"], ["--node-id"], ["--interval-max", "x"]])
def test_a_bad_flag_is_one_error_line_with_a_pointer_to_help(argv, capsys):
    """README: "one error line naming it". argparse printed its usage first,
    12 lines in all: now the error line alone, which points to --help."""
    code, err = _exit(argv, capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("gpulb-agent: error: ") and "gpulb-agent --help" in err, err
    assert "usage:" not in err


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


# ---- --coordinator: HOST:PORT, checked at start -----------------------------------------------


@pytest.mark.parametrize(
    "target, problem",
    [
        ("127.0.0.1", "no port"),  # gRPC dialled 443
        (":99999", "the port must be 1..65535, got '99999'"),  # dialled 99999 mod 65536
        ("h:0", "the port must be 1..65535, got '0'"),
        ("h:-1", "the port must be 1..65535, got '-1'"),
        ("h:http", "the port must be 1..65535, got 'http'"),
        ("", "no port"),  # "the target uri is not valid: dns:///", retried for ever
        ("not a target", "no port"),
        (":50051", "no host"),
        ("::1:50051", "an IPv6 address goes in brackets, as in [::1]:50051"),
        ("[::1]", "no port"),
        ("[]:50051", "'[]' is not an address in brackets"),
        ("a b:50051", "'a b' is not a host name or address"),
        ("dns:///h:50051", "'dns:///h' is not a host name or address"),
    ],
)
def test_a_coordinator_that_is_not_host_port_exits_2_at_start(target, problem, capsys):
    """QA: `127.0.0.1` dialled port 443, `:99999` another port, `""` retried
    for ever, and `--check --no-coordinator` passed them all."""
    for extra in ([], ["--check", "--no-coordinator"]):
        code, err = _exit([*extra, "--coordinator", target], capsys)
        assert code == 2 and err == f"gpulb-agent: error: argument --coordinator: {target!r} is not HOST:PORT ({problem})\n", err


def test_a_coordinator_in_the_config_file_is_named_with_the_file(tmp_path, capsys):
    path = tmp_path / "agent.toml"
    path.write_text('[agent]\ncoordinator = "10.0.0.5"\n')
    with pytest.raises(SystemExit) as info:
        agent_main.main(["--backend", "sim", "--config", str(path), "--check", "--no-coordinator"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err == f"gpulb-agent: error: {path}: option 'coordinator' '10.0.0.5' is not HOST:PORT (no port)\n", err
    # a flag overrides the file, and only what is used is checked
    settings = agent_main._settings(agent_main.parse_args(["--config", str(path), "--coordinator", "10.0.0.5:50051"]))
    assert settings["coordinator"] == "10.0.0.5:50051"


@pytest.mark.parametrize("target", ["127.0.0.1:50051", "[::1]:50051", "[fe80::1%eth0]:1", "gpu-coord.example.org:65535", "h:1"])
def test_host_port_coordinators_are_taken(target):
    assert agent_main._settings(agent_main.parse_args(["--coordinator", target]))["coordinator"] == target


# ---- labels: the coordinator's rule, at start -----------------------------------------------------


LABEL_RULE = "keys are 1-63 of [A-Za-z0-9._/-], values at most 256 characters"


@pytest.mark.parametrize(
    "label, said",
    [
        ("a b=c", "argument --label: 'a b=c'"),
        ("-rack=r1", "argument --label: '-rack=r1'"),
        ("k" * 64 + "=v", "argument --label: 'kkk"),
        ("rack=" + "v" * 257, "argument --label: 'rack=vvv"),
    ],
)
def test_a_label_the_coordinator_refuses_exits_2_at_start(label, said, capsys):
    """QA: `--label "a b=c" --check` passed, and a run exited 78 after
    connecting (registration_refused, a failed unit)."""
    for extra in (["--check", "--no-coordinator"], []):
        code, err = _exit([*extra, "--label", "rack=r1", f"--label={label}"], capsys)
        assert code == 2 and err.startswith(f"gpulb-agent: error: {said}") and len(err.splitlines()) == 1, err
        assert err.rstrip().endswith(f"is a label the coordinator refuses at registration: {LABEL_RULE}"), err


def test_labels_from_the_file_are_named_with_the_file_and_too_many_are_refused(tmp_path, capsys):
    path = tmp_path / "agent.toml"
    path.write_text('[agent]\nnode_id = "n1"\n[agent.labels]\nrack = "r1"\n"a b" = "c"\n')
    with pytest.raises(SystemExit) as info:
        agent_main.main(["--backend", "sim", "--config", str(path), "--check", "--no-coordinator"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err == (f"gpulb-agent: error: {path}: [agent.labels] 'a b' = 'c' is a label the "
                                            f"coordinator refuses at registration: {LABEL_RULE}\n"), err
    code, err = _exit([arg for i in range(65) for arg in ("--label", f"k{i}=v")], capsys)
    assert code == 2 and err == "gpulb-agent: error: --label: 65 labels; at most 64: the coordinator refuses them at registration\n", err


def test_labels_the_coordinator_takes_are_taken():
    labels = ["rack=r1", "topology.kubernetes.io/zone=eu-1a", "k" * 63 + "=" + "v" * 256, "empty="]
    settings = agent_main._settings(agent_main.parse_args([arg for label in labels for arg in ("--label", label)]))
    assert settings["labels"] == dict(label.split("=", 1) for label in labels)
