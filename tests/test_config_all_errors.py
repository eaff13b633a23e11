"""A wrong configuration is named whole in one run, not one problem per
restart: under systemd each restart showed the next mistake, so fixing N of
them took N restart loops. The coordinator (its file, environment and flags;
at start, ``--print-config`` and a SIGHUP reload) and the agent (agent.toml
and its flags) name every unknown table or option, every value of the wrong
type and every value out of range, one line each, and exit 2. A single
problem reads as it always did."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import structlog

from agent import main as agent_main
from coordinator import main as coordinator_main
from coordinator.settings import ConfigError, ConfigErrors, load_settings

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _no_gpulb_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("GPULB_")]:
        monkeypatch.delenv(name)


def _write(tmp_path: Path, text: str, name: str = "coordinator.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- the coordinator --------------------------------------------------------------------------------


THREE = "[coordinator]\ninsecure = true\nheartbeat_intervl_s = 5\nsignal_window = \"20\"\nstaleness_s = -1\n"


def test_a_typo_a_string_for_a_number_and_a_value_out_of_range_are_named_in_one_run(tmp_path: Path) -> None:
    path = _write(tmp_path, THREE)
    with pytest.raises(ConfigErrors) as caught:
        load_settings(path, {}, {})
    errors = caught.value.errors
    assert [(e.option, e.source) for e in errors] == [
        ("coordinator.heartbeat_intervl_s", f"file:{path}"),
        ("coordinator.signal_window", f"file:{path}"),
        ("coordinator.staleness_s", f"file:{path}"),
    ]
    # each line as the single error says it: the file, table.option, what is wrong
    assert str(errors[0]) == f"{path}: coordinator.heartbeat_intervl_s: unknown option; did you mean 'heartbeat_interval_s'?"
    assert str(errors[1]) == f"{path}: coordinator.signal_window: expected a whole number, got '20'"
    assert str(errors[2]).startswith(f"{path}: coordinator.staleness_s: must be ")
    lines = str(caught.value).splitlines()
    assert lines == ["3 problems in the configuration:", *(f"  {e}" for e in errors)]
    assert (caught.value.option, caught.value.source) == (errors[0].option, errors[0].source)  # a ConfigError, for its first


def test_unknown_tables_and_options_and_bad_variables_and_flags_are_named_together(tmp_path: Path) -> None:
    path = _write(tmp_path, 'listen = "127.0.0.1:1"\n[schedular]\nlease_s = 30\n[scheduler]\nqueue_head_limit = "8"\n'
                            "[advisor]\nheartbeat_interval_s = 5\n")
    env = {"GPULB_SCHEDULER_P0_SLA_S": "soon", "GPULB_SIGNAL_WINDOW": "many"}
    with pytest.raises(ConfigErrors) as caught:
        load_settings(path, env, {"grace_s": "later", "stalenes_s": 3})
    said = {(e.option, e.source): e.message for e in caught.value.errors}
    file = f"file:{path}"
    assert said[("listen", file)].endswith("; put it under [coordinator]")
    assert said[("[schedular]", file)].startswith("unknown table; did you mean 'scheduler'?")
    assert said[("scheduler.queue_head_limit", file)] == "expected a whole number, got '8'"
    assert said[("advisor.heartbeat_interval_s", file)] == "unknown option; it belongs in [coordinator]"
    assert said[("scheduler.p0_sla_s", "env:GPULB_SCHEDULER_P0_SLA_S")] == "expected a number, got 'soon'"
    assert said[("coordinator.signal_window", "env:GPULB_SIGNAL_WINDOW")] == "expected a whole number, got 'many'"
    assert said[("coordinator.grace_s", "flag")] == "expected a number, got 'later'"
    assert said[("stalenes_s", "flag")] == "unknown option; did you mean 'staleness_s'?"
    assert len(said) == 8
    text = str(caught.value)
    assert "environment variable GPULB_SCHEDULER_P0_SLA_S: scheduler.p0_sla_s:" in text
    assert "command-line flag: coordinator.grace_s:" in text


def test_a_file_that_is_not_toml_is_one_problem_and_the_variables_and_flags_are_still_checked(tmp_path: Path) -> None:
    path = _write(tmp_path, "[coordinator]\nlisten = \n")
    with pytest.raises(ConfigErrors) as caught:
        load_settings(path, {"GPULB_STALENESS_S": "-1"}, {"grace_s": "later"})
    assert [(e.option, e.source) for e in caught.value.errors] == [
        ("(syntax)", f"file:{path}"), ("coordinator.grace_s", "flag"), ("coordinator.staleness_s", "env:GPULB_STALENESS_S")]
    with pytest.raises(ConfigError) as alone:  # alone, as before
        load_settings(path, {}, {})
    assert not isinstance(alone.value, ConfigErrors) and alone.value.option == "(syntax)"


def test_rules_across_options_wait_for_the_tables_values_and_other_tables_are_still_checked(tmp_path: Path) -> None:
    # [scheduler]: memory_reject_pct refused, so memory_warn_pct = 95 is not
    # judged against the default 90 it was never meant to meet; [advisor]'s
    # own rule is still checked, with the [coordinator] typo
    path = _write(tmp_path, "[coordinator]\nlistn = 'x'\n[scheduler]\nmemory_warn_pct = 95\nmemory_reject_pct = 'high'\n")
    with pytest.raises(ConfigErrors) as caught:
        load_settings(path, {}, {})
    assert [e.option for e in caught.value.errors] == ["coordinator.listn", "scheduler.memory_reject_pct"]
    path.write_text("[coordinator]\nlistn = 'x'\n[scheduler]\nmemory_warn_pct = 95\n")
    with pytest.raises(ConfigErrors) as caught:
        load_settings(path, {}, {})
    assert [e.option for e in caught.value.errors] == ["coordinator.listn", "scheduler.memory_warn_pct"]
    assert "must be below memory_reject_pct" in caught.value.errors[1].message


def test_every_value_a_table_s_own_check_refuses_is_named_in_one_run(tmp_path: Path) -> None:
    """QA pass 25: a table's validate() stops at its first problem, and a table
    with a value refused was not checked at all: three mistakes in
    [scheduler] took three runs of --print-config."""
    path = _write(tmp_path, '[scheduler]\npolicy = "nosuch"\nmemory_reject_pct = 150\n'
                            'tenant_max_priority = {interns = "P9"}\np0_sla_s = -1\n')
    with pytest.raises(ConfigErrors) as caught:
        load_settings(path, {}, {})
    assert [e.option for e in caught.value.errors] == [  # the ranges of the options' own, then the table's check
        "scheduler.p0_sla_s", "scheduler.policy", "scheduler.memory_reject_pct", "scheduler.tenant_max_priority[interns]"]


def test_a_single_problem_of_each_kind_reads_as_before(tmp_path: Path) -> None:
    for text, expected in (
        ("[coordinator]\nheartbeat_intervl_s = 5\n", "coordinator.heartbeat_intervl_s: unknown option; did you mean 'heartbeat_interval_s'?"),
        ("[coordinator]\nheartbeat_interval_s = 'soon'\n", "coordinator.heartbeat_interval_s: expected a number, got 'soon'"),
        ("[schedular]\n", "[schedular]: unknown table; did you mean 'scheduler'?"),
    ):
        path = _write(tmp_path, text)
        with pytest.raises(ConfigError) as caught:
            load_settings(path, {}, {})
        assert not isinstance(caught.value, ConfigErrors)
        assert str(caught.value).startswith(f"{path}: {expected}"), str(caught.value)


def test_the_coordinator_and_print_config_name_every_problem_one_a_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, THREE)
    monkeypatch.setenv("GPULB_SCHEDULER_P0_SLA_S", "soon")
    for extra in (["--print-config"], []):
        assert coordinator_main.main(["--config", str(path), "--grace-s", "later", *extra]) == 2
        out, err = capsys.readouterr()
        assert out == ""
        lines = err.splitlines()
        assert lines[0] == "gpulb-coordinator: 5 problems in the configuration:", err
        assert lines[1:] == [
            f"  {path}: coordinator.heartbeat_intervl_s: unknown option; did you mean 'heartbeat_interval_s'?",
            f"  {path}: coordinator.signal_window: expected a whole number, got '20'",
            "  environment variable GPULB_SCHEDULER_P0_SLA_S: scheduler.p0_sla_s: expected a number, got 'soon'",
            "  command-line flag: coordinator.grace_s: expected a number, got 'later'",
            lines[5],
        ], err
        assert lines[5].startswith(f"  {path}: coordinator.staleness_s: must be "), err


def test_a_sighup_reload_keeps_the_running_configuration_and_logs_every_problem(tmp_path: Path) -> None:
    from coordinator.main import _Daemon
    from coordinator.security import Security

    path = _write(tmp_path, "[coordinator]\nlisten = '127.0.0.1:0'\n")
    settings = load_settings(path, {}, {})
    daemon = _Daemon(settings, str(path), {}, Security(insecure=True))
    path.write_text("[coordinator]\nlisten = '127.0.0.1:0'\ndispatch_intervl_s = 0.25\nheartbeat_interval_s = 'soon'\n"
                    "[scheduler]\nlease_s = 0\n")
    saved = structlog.get_config()
    try:
        with structlog.testing.capture_logs() as logs:
            daemon.reload()
    finally:
        structlog.configure(**saved)
    assert daemon.settings is settings
    [rejected] = [e for e in logs if e["event"] == "reload_rejected"]
    error = rejected["error"]
    assert error.startswith("3 problems in the configuration:"), error
    for needle in ("coordinator.dispatch_intervl_s: unknown option; did you mean 'dispatch_interval_s'?",
                   "coordinator.heartbeat_interval_s: expected a number, got 'soon'",
                   "scheduler.lease_s: must be "):
        assert f"{path}: {needle}" in error, error


# ---- the agent -----------------------------------------------------------------------------------


def _agent_exit(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as info:
        agent_main.main(["--backend", "sim", "--coordinator", "127.0.0.1:1", *argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return info.value.code, err.splitlines()


def test_agent_toml_with_a_typo_a_string_for_a_number_and_a_value_out_of_range_names_all_three(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, '[agent]\nsim_gpu = 2\nsim_seed = "7"\noutage_buffer = -1\n', "agent.toml")
    code, lines = _agent_exit(["--config", str(path)], capsys)
    assert code == 2
    assert lines[0].startswith(f"gpulb-agent: error: {path}: unknown option 'sim_gpu' (known: "), lines
    assert lines[1:] == [
        f"gpulb-agent: error: {path}: option 'sim_seed' must be an integer, got '7'",
        f"gpulb-agent: error: {path}: option 'outage_buffer' must be an integer in 1..1000000, got -1",
    ], lines


def test_agent_flag_and_file_problems_are_named_together(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, '[agent]\nbackend = "nvlm"\nnode_id = "rack 4/gpu-01"\n[agent.labels]\n"a b" = "c"\n', "agent.toml")
    code, lines = _agent_exit(["--config", str(path), "--sim-gpus", "0", "--log-format", "xml", "--bogus",
                               "--interval-min", "nan", "--label=-rack=r1", "--check", "--no-coordinator"], capsys)
    pointer = " (gpulb-agent --help lists the flags)"
    assert code == 2
    # the file's options, then the flags, then what the merged values break
    assert lines[0] == f"gpulb-agent: error: {path}: option 'backend' must be one of nvml, sim, auto, got 'nvlm'", lines
    assert lines[1] == f"gpulb-agent: error: argument --sim-gpus: must be an integer in 1..64, got 0{pointer}", lines
    assert lines[2].startswith("gpulb-agent: error: argument --log-format: invalid choice: 'xml'") and lines[2].endswith(pointer)
    assert lines[3] == f"gpulb-agent: error: argument --interval-min: must be a number in 0.01..60, got nan{pointer}", lines
    assert lines[4] == f"gpulb-agent: error: unrecognized arguments: --bogus{pointer}", lines
    rule = "is a label the coordinator refuses at registration: keys are 1-63 of [A-Za-z0-9._/-], values at most 256 characters"
    assert lines[5:] == [
        f"gpulb-agent: error: {path}: option 'node_id' 'rack 4/gpu-01' is not a node id the coordinator accepts: "
        "it must be 1-128 of [A-Za-z0-9._-], starting alphanumeric",
        f"gpulb-agent: error: {path}: [agent.labels] 'a b' = 'c' {rule}",
        f"gpulb-agent: error: argument --label: '-rack=r1' {rule}",
    ], lines


def test_agent_checks_of_merged_values_leave_out_refused_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A refused value is not replaced by its default and judged: node_id = 7
    does not also blame a hostname the operator meant to override, and
    --interval-max x does not make interval_min = 3 'above the default 2 s'.
    A flag that sets the value right is checked as usual."""
    monkeypatch.setattr(agent_main.socket, "gethostname", lambda: "_build host")
    path = _write(tmp_path, "[agent]\nnode_id = 7\ninterval_min = 3.0\n", "agent.toml")
    code, lines = _agent_exit(["--config", str(path), "--interval-max", "x"], capsys)
    assert code == 2 and len(lines) == 2, lines
    assert lines[0] == f"gpulb-agent: error: {path}: option 'node_id' must be a string, got 7"
    assert lines[1].startswith("gpulb-agent: error: argument --interval-max: must be a number in 0.01..60, got 'x'")
    code, lines = _agent_exit(["--config", str(path), "--node-id", "gpu-1", "--interval-max", "1"], capsys)
    assert code == 2 and lines == [
        f"gpulb-agent: error: {path}: option 'node_id' must be a string, got 7",
        f"gpulb-agent: error: interval_min in {path} (3 s) is above --interval-max (1 s): the fastest sampling period "
        "cannot exceed the slowest",
    ], lines


def test_agent_names_every_refused_label_and_too_many(capsys: pytest.CaptureFixture[str]) -> None:
    labels = [f"k{i}=v" for i in range(64)] + ["a b=c", "-x=y"]
    code, lines = _agent_exit([f"--label={label}" for label in labels], capsys)
    assert code == 2 and len(lines) == 3, lines
    assert lines[0] == "gpulb-agent: error: --label: 66 labels; at most 64: the coordinator refuses them at registration"
    assert lines[1].startswith("gpulb-agent: error: argument --label: 'a b=c' is a label the coordinator refuses")
    assert lines[2].startswith("gpulb-agent: error: argument --label: '-x=y' is a label the coordinator refuses")


def test_agent_flags_argparse_cannot_parse_past_still_name_what_came_before(capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = _agent_exit(["--sim-gpus", "0", "--node-id"], capsys)
    assert code == 2 and len(lines) == 2, lines
    assert lines[0].startswith("gpulb-agent: error: argument --sim-gpus: must be an integer in 1..64, got 0")
    assert lines[1].startswith("gpulb-agent: error: argument --node-id: expected one argument")


def test_agent_an_unreadable_file_is_one_problem_and_the_flags_are_still_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.toml"
    code, lines = _agent_exit(["--config", str(missing), "--sim-gpus", "65", "--interval-min", "5"], capsys)
    # interval_max is the file's, unknown: --interval-min 5 is not judged against a default
    assert code == 2 and len(lines) == 2, lines
    assert lines[0].startswith(f"gpulb-agent: error: --config {missing}: ")
    assert lines[1].startswith("gpulb-agent: error: argument --sim-gpus: must be an integer in 1..64, got 65")


def test_agent_toml_keys_beside_the_agent_table_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """QA pass 25: a key above [agent] (a common slip) or a misspelt [agnet]
    beside it was dropped without a word, and the agent ran on defaults."""
    path = tmp_path / "agent.toml"
    path.write_text('backend = "sim"\n[agent]\nnode_id = "n1"\n[agnet]\nsim_gpus = 999\n')
    code, lines = _agent_exit(["--config", str(path)], capsys)
    assert code == 2
    assert any("option 'backend' outside [agent]" in line for line in lines), lines
    assert any("table 'agnet' outside [agent]" in line for line in lines), lines


def test_agent_check_json_says_why_the_backend_cannot_start() -> None:
    import json
    import subprocess
    import sys

    # in a process of its own: the check sets up the agent's logging
    run = subprocess.run([sys.executable, "-m", "agent.main", "--backend", "nvml", "--check", "--no-coordinator",
                          "--json", "--node-id", "n1"], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parent.parent)
    if run.returncode == 0:
        pytest.skip("NVML is available here")
    assert run.returncode == 2, run.stderr
    report = json.loads(run.stdout)
    assert report["ok"] is False and report["backend"]["name"] == "nvml" and report["backend"]["error"]
