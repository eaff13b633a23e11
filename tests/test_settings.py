"""Configuration loading: defaults < file < environment < flags, parsing by the
fields' types, errors that name the option and the file, ``--print-config``
round trips and the SIGHUP diff. Real TOML files in tmp_path, no mocks."""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.settings import (
    SECTIONS,
    ConfigError,
    Section,
    add_settings_flags,
    diff_settings,
    env_names,
    flag_overrides,
    load_settings,
    options,
    render_settings,
)
from scheduler.advisor import AdvisorConfig
from scheduler.config import SchedulerConfig
from scheduler.predictor import PredictorConfig


def _write(tmp_path: Path, text: str, name: str = "coordinator.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _all_keys() -> list[str]:
    return [f"{section.name}.{f.name}" for section in SECTIONS for f in dataclasses.fields(section.cls)]


# ---- defaults and precedence ------------------------------------------------------------


def test_defaults_are_the_dataclasses_defaults() -> None:
    s = load_settings(None, {}, {})
    assert s.coordinator == CoordinatorConfig()
    assert s.scheduler == SchedulerConfig()
    assert s.advisor == AdvisorConfig() and s.predictor == PredictorConfig()
    assert s.config_path is None
    # Every field of the four dataclasses is an option, each with its source.
    assert sorted(s.sources) == sorted(_all_keys())
    assert set(s.sources.values()) == {"default"}


@pytest.mark.parametrize(
    "layers, expected, source",
    [
        ((), 10.0, "default"),
        (("file",), 20.0, "file"),
        (("file", "env"), 30.0, "env:GPULB_HEARTBEAT_INTERVAL_S"),
        (("env",), 30.0, "env:GPULB_HEARTBEAT_INTERVAL_S"),
        (("file", "env", "flag"), 40.0, "flag"),
        (("file", "flag"), 40.0, "flag"),
    ],
)
def test_precedence(tmp_path: Path, layers: tuple[str, ...], expected: float, source: str) -> None:
    path = _write(tmp_path, "[coordinator]\nheartbeat_interval_s = 20\nstaleness_s = 7.5\n")
    env = {"GPULB_HEARTBEAT_INTERVAL_S": "30"} if "env" in layers else {}
    flags = {"heartbeat_interval_s": "40"} if "flag" in layers else {}
    s = load_settings(path if "file" in layers else None, env, flags)
    assert s.coordinator.heartbeat_interval_s == expected
    assert isinstance(s.coordinator.heartbeat_interval_s, float)
    want = f"file:{path}" if source == "file" else source
    assert s.sources["coordinator.heartbeat_interval_s"] == want
    # An option set only in the file keeps the file's value whatever else is set.
    if "file" in layers:
        assert s.coordinator.staleness_s == 7.5
        assert s.sources["coordinator.staleness_s"] == f"file:{path}"
        assert s.config_path == str(path)


def test_relative_config_path_is_recorded_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path, "[coordinator]\ngrace_s = 2\n")
    monkeypatch.chdir(tmp_path)
    s = load_settings("coordinator.toml", {}, {})
    assert s.sources["coordinator.grace_s"] == f"file:{tmp_path / 'coordinator.toml'}"


def test_none_overrides_mean_flag_not_given(tmp_path: Path) -> None:
    path = _write(tmp_path, "[coordinator]\nlisten = \"0.0.0.0:6000\"\n")
    s = load_settings(path, {}, {"listen": None, "grace_s": None})
    assert s.coordinator.listen == "0.0.0.0:6000"
    assert s.sources["coordinator.grace_s"] == "default"


def test_overrides_may_name_scheduler_options_and_pass_typed_values() -> None:
    s = load_settings(None, {}, {"scheduler.policy": "binpack", "grace_s": 2, "scheduler.class_weights": (4, 3, 2, 1)})
    assert s.scheduler.policy == "binpack" and s.sources["scheduler.policy"] == "flag"
    assert s.coordinator.grace_s == 2.0 and isinstance(s.coordinator.grace_s, float)
    assert s.scheduler.class_weights == (4, 3, 2, 1)


# ---- environment parsing by type ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name, text, key, expected",
    [
        ("GPULB_LISTEN", "0.0.0.0:7000", "coordinator.listen", "0.0.0.0:7000"),
        ("GPULB_METRICS_LISTEN", "", "coordinator.metrics_listen", ""),
        ("GPULB_SIGNAL_WINDOW", " 64 ", "coordinator.signal_window", 64),
        ("GPULB_EWMA_ALPHA", "0.25", "coordinator.ewma_alpha", 0.25),
        ("GPULB_MAX_MESSAGE_BYTES", "1_048_576", "coordinator.max_message_bytes", 1048576),
        ("GPULB_SCHEDULER_USE_FORECAST", "false", "scheduler.use_forecast", False),
        ("GPULB_SCHEDULER_USE_FORECAST", "0", "scheduler.use_forecast", False),
        ("GPULB_SCHEDULER_USE_FORECAST", "Yes", "scheduler.use_forecast", True),
        ("GPULB_SCHEDULER_USE_FORECAST", "on", "scheduler.use_forecast", True),
        ("GPULB_SCHEDULER_CLASS_WEIGHTS", "16, 4,2 ,1", "scheduler.class_weights", (16, 4, 2, 1)),
        ("GPULB_SCHEDULER_PROMOTE_AFTER_S", "10,20.5,30", "scheduler.promote_after_s", (10.0, 20.5, 30.0)),
        ("GPULB_SCHEDULER_RETRY_KINDS", "training, batch", "scheduler.retry_kinds", frozenset({"training", "batch"})),
        ("GPULB_SCHEDULER_RETRY_KINDS", "", "scheduler.retry_kinds", frozenset()),
        (
            "GPULB_SCHEDULER_TENANT_MEMORY_REJECT_PCT",
            "team-a=90, team-b = 95.5",
            "scheduler.tenant_memory_reject_pct",
            {"team-a": 90.0, "team-b": 95.5},
        ),
        ("GPULB_SCHEDULER_WEIGHTS", "load=2,stale=0", "scheduler.weights", {"load": 2.0, "stale": 0.0}),
        ("GPULB_SCHEDULER_POLICY", "least_connections", "scheduler.policy", "least_connections"),
    ],
)
def test_environment_is_parsed_by_the_fields_type(name: str, text: str, key: str, expected: Any) -> None:
    s = load_settings(None, {name: text}, {})
    section, _, option = key.partition(".")
    value = getattr(getattr(s, section), option)
    assert value == expected
    assert type(value) is type(expected)
    assert s.sources[key] == f"env:{name}"


@pytest.mark.parametrize(
    "name, text, option, fragment",
    [
        ("GPULB_HEARTBEAT_INTERVAL_S", "ten", "coordinator.heartbeat_interval_s", "expected a number, got 'ten'"),
        ("GPULB_SIGNAL_WINDOW", "3.5", "coordinator.signal_window", "expected a whole number"),
        ("GPULB_SCHEDULER_USE_FORECAST", "maybe", "scheduler.use_forecast", "expected true or false"),
        ("GPULB_SCHEDULER_CLASS_WEIGHTS", "8,4,2", "scheduler.class_weights", "expected 4 values"),
        ("GPULB_SCHEDULER_CLASS_WEIGHTS", "8,4,x,1", "scheduler.class_weights", "item 2: expected a whole number"),
        ("GPULB_SCHEDULER_WEIGHTS", "load", "scheduler.weights", "KEY=VALUE"),
        ("GPULB_SCHEDULER_WEIGHTS", "load=heavy", "scheduler.weights", "[load]: expected a number"),
        ("GPULB_STALENESS_S", "nan", "coordinator.staleness_s", "finite"),
        ("GPULB_GRACE_S", "-1", "coordinator.grace_s", ">= 0 s"),
        ("GPULB_LOG_LEVEL", "verbose", "coordinator.log_level", "one of debug, info, warning, error"),
        ("GPULB_LISTEN", "localhost", "coordinator.listen", "HOST:PORT"),
        ("GPULB_LISTEN", "localhost:70000", "coordinator.listen", "HOST:PORT"),
    ],
)
def test_environment_errors_name_the_variable_and_option(name: str, text: str, option: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(None, {name: text}, {})
    err = info.value
    assert err.option == option
    assert err.source == f"env:{name}"
    assert fragment in err.message
    assert f"environment variable {name}" in str(err) and option in str(err)


def test_near_miss_variables_are_reported_and_others_left_alone() -> None:
    s = load_settings(None, {"GPULB_HEARTBEAT_INTERVAL": "5", "GPULB_COORDINATOR": "x:1", "GPULB_TRACES": "/t", "HOME": "/root"}, {})
    assert s.warnings == ("environment variable GPULB_HEARTBEAT_INTERVAL is not a setting; did you mean GPULB_HEARTBEAT_INTERVAL_S?",)
    assert s.coordinator.heartbeat_interval_s == 10.0


def test_every_option_has_its_own_variable() -> None:
    index = env_names()
    assert len(index) == len(_all_keys())
    assert index["GPULB_LISTEN"].key == "coordinator.listen"
    assert index["GPULB_SCHEDULER_P0_SLA_S"].key == "scheduler.p0_sla_s"
    assert index["GPULB_ADVISOR_VARIANCE_THRESHOLD"].key == "advisor.variance_threshold"
    assert index["GPULB_PREDICTOR_ALPHA"].key == "predictor.alpha"
    assert index["GPULB_MEMORY_GROWTH_MIN_SAMPLES"].key == "memory_growth.min_samples"


# ---- the file: unknown names, types, syntax -----------------------------------------------------


@pytest.mark.parametrize(
    "text, option, fragment",
    [
        ("[schedular]\npolicy = 'binpack'\n", "[schedular]", "unknown table; did you mean 'scheduler'?"),
        ("[metrics]\nport = 1\n", "[metrics]", "unknown table (tables: coordinator, scheduler, advisor, predictor, memory_growth)"),
        ("[coordinator]\nheartbeat_interval = 5\n", "coordinator.heartbeat_interval", "did you mean 'heartbeat_interval_s'?"),
        ("[coordinator]\npolicy = 'binpack'\n", "coordinator.policy", "it belongs in [scheduler]"),
        ("[scheduler]\nlisten = ':1'\n", "scheduler.listen", "it belongs in [coordinator]"),
        ("listen = '0.0.0.0:1'\n", "listen", "put it under [coordinator]"),
        ("coordinator = 3\n", "coordinator", "must be a table"),
        ("[coordinator]\nheartbeat_interval_s = '10'\n", "coordinator.heartbeat_interval_s", "expected a number, got '10'"),
        ("[coordinator]\nsignal_window = true\n", "coordinator.signal_window", "expected a whole number, got True"),
        ("[coordinator]\nsignal_window = 2.5\n", "coordinator.signal_window", "expected a whole number"),
        ("[coordinator]\nlisten = 50051\n", "coordinator.listen", "expected a string"),
        ("[scheduler]\nuse_forecast = 'yes'\n", "scheduler.use_forecast", "expected true or false"),
        ("[scheduler]\nweights = [1, 2]\n", "scheduler.weights", "expected a table"),
        ("[scheduler]\nretry_kinds = 'batch'\n", "scheduler.retry_kinds", "expected a list"),
        ("[scheduler]\nclass_weights = [8, 4, 2, 1, 1]\n", "scheduler.class_weights", "expected 4 values"),
        ("[coordinator]\nsmoothing_tick_s = inf\n", "coordinator.smoothing_tick_s", "finite"),
    ],
)
def test_file_errors_name_the_option_and_the_file(tmp_path: Path, text: str, option: str, fragment: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_settings(path, {}, {})
    err = info.value
    assert (err.option, err.source) == (option, f"file:{path}")
    assert fragment in err.message, err.message
    assert str(err).startswith(f"{path}: {option}: ")


def test_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "[coordinator]\nlisten = \"127.0.0.1:1\"\ngrace_s = = 3\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, {}, {})
    assert info.value.source == f"file:{path}"
    assert "line 3" in str(info.value) and str(path) in str(info.value)


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_settings(path, {}, {})
    assert info.value.option == "--config"
    assert str(path) in str(info.value) and "No such file" in str(info.value)


# ---- validation across options -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, option, fragment",
    [
        ("[scheduler]\nmemory_warn_pct = 90\n", "scheduler.memory_warn_pct", "must be below memory_reject_pct"),
        ("[scheduler]\nclass_weights = [8, 4, 0, 1]\n", "scheduler.class_weights[2]", "integer >= 1"),
        ("[scheduler]\npolicy = 'fastest'\n", "scheduler.policy", "must be one of round_robin"),
        ("[scheduler]\nweights = { lod = 2.0 }\n", "scheduler.weights[lod]", "has no weight 'lod'"),
        ("[scheduler]\npolicy = 'binpack'\nweights = { load = 2.0 }\n", "scheduler.weights[load]", "policy binpack has no weight"),
        ("[scheduler]\nweights = { load = -1 }\n", "scheduler.weights[load]", ""),
        ("[scheduler]\ntenant_memory_reject_pct = { a = 120 }\n", "scheduler.tenant_memory_reject_pct[a]", "(0, 100]"),
        ("[advisor]\nhot_pct = 120\n", "advisor.hot_pct", "must be in [0, 100]"),
        ("[advisor]\nmax_slowdown_ratio = 0.5\n", "advisor.max_slowdown_ratio", ">= 1"),
        ("[predictor]\nalpha = 0\n", "predictor.alpha", "must be in (0, 1]"),
        ("[memory_growth]\nmin_samples = 600\n", "memory_growth.min_samples", "must be <= window (512)"),
        ("[scheduler]\nweights = { oom_risk = -1 }\n", "scheduler.weights[oom_risk]", ""),
    ],
)
def test_validation_names_the_option_and_the_file(tmp_path: Path, text: str, option: str, fragment: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_settings(path, {}, {})
    assert info.value.option == option
    assert info.value.source == f"file:{path}"
    assert fragment in info.value.message
    assert str(path) in str(info.value)


def test_a_default_made_invalid_by_another_option_points_at_it(tmp_path: Path) -> None:
    # memory_reject_pct below the default memory_warn_pct (70): the scheduler
    # names memory_warn_pct, which the operator never set; say what was set.
    path = _write(tmp_path, "[scheduler]\nmemory_reject_pct = 60\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, {}, {})
    err = info.value
    assert err.option == "scheduler.memory_warn_pct" and err.source == f"file:{path}"
    assert f"memory_warn_pct is at its default; options set: scheduler.memory_reject_pct ({path})" in err.message
    # With several layers set, the one the operator touched last is blamed.
    with pytest.raises(ConfigError) as info:
        load_settings(path, {"GPULB_SCHEDULER_P0_SLA_S": "3"}, {})
    assert info.value.source == "env:GPULB_SCHEDULER_P0_SLA_S"
    assert f"scheduler.memory_reject_pct ({path})" in info.value.message


def test_validation_error_from_the_environment_names_the_variable() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(None, {"GPULB_SCHEDULER_P0_SLA_S": "0"}, {})
    assert info.value.source == "env:GPULB_SCHEDULER_P0_SLA_S"
    assert "environment variable GPULB_SCHEDULER_P0_SLA_S" in str(info.value)


def test_bad_flag_value_and_unknown_override() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(None, {}, {"heartbeat_interval_s": "soon"})
    assert (info.value.option, info.value.source) == ("coordinator.heartbeat_interval_s", "flag")
    assert "command-line flag" in str(info.value)
    with pytest.raises(ConfigError, match="did you mean 'staleness_s'"):
        load_settings(None, {}, {"stalenes_s": 3})


# ---- rendering (--print-config) ------------------------------------------------------------------------


def test_print_config_round_trips_through_a_file(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "\n".join(
            [
                "[coordinator]",
                'state_dir = \'C:\\new "dir" é\'',
                "heartbeat_interval_s = 12",
                "[scheduler]",
                "policy = 'weighted_round_robin'",
                "weights = { speed = 2.0, memory = 0.5 }",
                'tenant_memory_reject_pct = { "team a" = 90, team-b = 95.5 }',
                "retry_kinds = ['batch']",
                "promote_after_s = [1, 2, 3.5]",
                "use_forecast = false",
            ]
        ),
    )
    env = {"GPULB_SCHEDULER_CLASS_WEIGHTS": "16,8,2,1", "GPULB_EWMA_ALPHA": "0.125"}
    s = load_settings(path, env, {"max_message_bytes": "65536"})
    text = render_settings(s)
    again = load_settings(_write(tmp_path, text, "printed.toml"), {}, {})
    assert again.coordinator == s.coordinator
    assert again.scheduler == s.scheduler
    assert again.coordinator.state_dir == 'C:\\new "dir" é'
    # Each option says where its value came from.
    blocks = text.split("\n\n")
    by_option = {b.strip().splitlines()[-1].split(" = ")[0]: b for b in blocks if " = " in b}
    assert "# source: env:GPULB_EWMA_ALPHA" in by_option["ewma_alpha"]
    assert "# source: flag" in by_option["max_message_bytes"]
    assert f"# source: file:{path}" in by_option["policy"]
    assert "# source: default" in by_option["listen"]


def test_every_option_is_rendered_with_unit_help_env_and_flag() -> None:
    text = render_settings(load_settings(None, {}, {}))
    data = tomllib.loads(text)
    for section in (("coordinator", CoordinatorConfig), ("scheduler", SchedulerConfig)):
        name, cls = section
        assert set(data[name]) == {f.name for f in dataclasses.fields(cls)}
    block = next(b for b in text.split("\n\n") if "heartbeat_interval_s = " in b)
    assert block.splitlines() == [
        "# a node silent this long is UNREACHABLE (no new tasks)",
        "# unit: s; range: [0.1, 1000000]; default: 10.0; env: GPULB_HEARTBEAT_INTERVAL_S; flag: --heartbeat-interval-s",
        "# source: default",
        "heartbeat_interval_s = 10.0",
    ]
    sched = next(b for b in text.split("\n\n") if "temperature_reject_c = " in b)
    assert "# °C at or above which a GPU takes no new task." in sched
    assert "unit: °C" in sched and "env: GPULB_SCHEDULER_TEMPERATURE_REJECT_C" in sched and "flag:" not in sched


def test_every_option_has_help() -> None:
    # A field added without a description would print as "(no description)".
    missing = [o.key for s in SECTIONS for o in options(s) if not o.help]
    assert missing == []


def test_commented_example_loads_as_the_defaults(tmp_path: Path) -> None:
    text = render_settings(load_settings(None, {}, {}), commented_defaults=True)
    s = load_settings(_write(tmp_path, text), {}, {})
    assert s.coordinator == CoordinatorConfig() and s.scheduler == SchedulerConfig()
    for key in _all_keys():
        assert f"\n# {key.partition('.')[2]} = " in text, key
    # Non-default values stay live even in this form.
    s2 = load_settings(None, {"GPULB_GRACE_S": "1"}, {})
    assert "\ngrace_s = 1.0\n" in render_settings(s2, commented_defaults=True)


# ---- diff (what SIGHUP changed) ----------------------------------------------------------------------


def test_diff_lists_exactly_what_changed(tmp_path: Path) -> None:
    old = load_settings(None, {}, {})
    path = _write(tmp_path, "[coordinator]\nheartbeat_interval_s = 20\n[scheduler]\npolicy = 'binpack'\nweights = { nvlink = 1.0 }\n")
    new = load_settings(path, {}, {})
    assert diff_settings(old, new) == [
        ("coordinator.heartbeat_interval_s", 10.0, 20.0),
        ("scheduler.policy", "load_aware", "binpack"),
        ("scheduler.weights", {}, {"nvlink": 1.0}),
    ]
    assert diff_settings(new, load_settings(path, {}, {})) == []


# ---- flags -------------------------------------------------------------------------------------------


def test_flags_cover_every_coordinator_option_and_feed_load_settings(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="gpulb-coordinator")
    add_settings_flags(parser)
    flags = {a for action in parser._actions for a in action.option_strings}
    for f in dataclasses.fields(CoordinatorConfig):
        assert "--" + f.name.replace("_", "-") in flags
    assert {"--config", "--print-config"} <= flags
    assert not any(f.startswith("--class-weights") for f in flags)  # scheduler: file and env only

    path = _write(tmp_path, "[coordinator]\nheartbeat_interval_s = 20\nlog_level = 'warning'\n")
    args = parser.parse_args(["--config", str(path), "--heartbeat-interval-s", "12.5", "--log-level", "debug"])
    assert args.print_config is False
    assert flag_overrides(args) == {"heartbeat_interval_s": "12.5", "log_level": "debug"}
    s = load_settings(args.config, {}, flag_overrides(args))
    assert s.coordinator.heartbeat_interval_s == 12.5 and s.coordinator.log_level == "debug"
    assert s.sources["coordinator.heartbeat_interval_s"] == "flag"

    assert flag_overrides(parser.parse_args([])) == {}
    with pytest.raises(SystemExit):
        parser.parse_args(["--log-level", "loud"])  # choices come from the option table
    help_text = parser.format_help()
    assert "GPULB_HEARTBEAT_INTERVAL_S" in help_text and "[s]" in help_text


# ---- genericity: the loader walks whatever fields a dataclass has ----------------------------------------


@dataclass
class _Future:
    window_s: float = field(default=1.0, metadata={"help": "a window", "unit": "s"})
    # Names of things, one per line.
    names: tuple[str, ...] = ()
    limit_pct: int | None = None
    mode: str = field(default="a", metadata={"help": "mode", "unit": "", "choices": ("a", "b")})


def test_options_walk_any_dataclass() -> None:
    opts = {o.name: o for o in options(Section("future", _Future, "FUT_", flags=True))}
    assert list(opts) == ["window_s", "names", "limit_pct", "mode"]
    assert (opts["window_s"].help, opts["window_s"].unit, opts["window_s"].flag) == ("a window", "s", "--window-s")
    assert opts["names"].help == "Names of things, one per line."
    assert opts["limit_pct"].unit == "%" and opts["limit_pct"].env == "FUT_LIMIT_PCT"
    assert opts["mode"].choices == ("a", "b") and opts["mode"].unit == ""


def test_runtime_tuning_choices() -> None:
    import asyncio
    import gc

    from coordinator.main import event_loop_runner, tune_gc

    runner, name = event_loop_runner("asyncio")
    assert (runner, name) == (asyncio.run, "asyncio")
    _, auto = event_loop_runner("auto")
    assert auto == "uvloop"  # a dependency, so installed wherever gpulb is
    before = gc.get_threshold()
    try:
        tune_gc(50_000)
        assert gc.get_threshold() == (50_000, before[1], before[2])
        tune_gc(0)  # 0 leaves the thresholds alone
        assert gc.get_threshold() == (50_000, before[1], before[2])
    finally:
        gc.set_threshold(*before)
    with pytest.raises(ConfigError, match="must be one of auto, uvloop, asyncio"):
        load_settings(None, {"GPULB_EVENT_LOOP": "tokio"}, {})


# ---- every option's range, checked at load (and so on SIGHUP) ----------------------------------------

# (table.option, TOML value, what the message says): each is refused at load,
# naming the file and the option. Each passed --print-config once and then
# crashed the start (ewma_alpha, signal_window, persist, z_max, iqr_k,
# state_synchronous, rpc_burst, max_message_bytes, gc_gen0_threshold, ...),
# spun a core (smoothing_tick_s, dispatch_interval_s, heartbeat_interval_s = 0)
# or failed every agent registration (a staleness_s whose ms overflow uint32).
_REFUSED = [
    ("coordinator.state_synchronous", '"bogus"', "must be one of NORMAL, FULL; got 'bogus'"),
    ("coordinator.ewma_alpha", "1.5", "must be in (0, 1], got 1.5"),
    ("coordinator.ewma_alpha", "0", "must be in (0, 1], got 0.0"),
    ("coordinator.ewma_alpha", "nan", "must be a finite number"),
    ("coordinator.signal_window", "0", "must be in [5, 1000] readings, got 0"),
    ("coordinator.signal_window", "4", "must be in [5, 1000] readings"),
    ("coordinator.signal_window", "1001", "must be in [5, 1000] readings"),
    ("coordinator.z_max", "-1", "must be > 0, got -1.0"),
    ("coordinator.z_max", "0", "must be > 0"),
    ("coordinator.iqr_k", "-2", "must be > 0, got -2.0"),
    ("coordinator.iqr_k", "0", "must be > 0"),
    ("coordinator.persist", "0", "must be >= 2 readings, got 0"),
    ("coordinator.persist", "1", "must be >= 2 readings"),
    ("coordinator.persist", "31", "must be <= signal_window (30), got 31"),
    ("coordinator.smoothing_tick_s", "0", "must be in [0.001, 1] s, got 0.0"),
    ("coordinator.smoothing_tick_s", "0.0001", "must be in [0.001, 1] s"),
    ("coordinator.smoothing_tick_s", "2", "must be in [0.001, 1] s"),
    ("coordinator.dispatch_interval_s", "0", "must be in [0.001, 60] s, got 0.0"),
    ("coordinator.dispatch_interval_s", "-1", "must be in [0.001, 60] s"),
    ("coordinator.dispatch_interval_s", "inf", "must be a finite number"),
    ("coordinator.dispatch_interval_s", "61", "must be in [0.001, 60] s"),
    ("coordinator.heartbeat_interval_s", "0", "must be in [0.1, 1000000] s, got 0.0"),
    ("coordinator.heartbeat_interval_s", "0.05", "must be in [0.1, 1000000] s"),
    ("coordinator.heartbeat_interval_s", "1e7", "must be in [0.1, 1000000] s"),
    ("coordinator.remove_after_intervals", "0", "must be >= 1 intervals, got 0"),
    ("coordinator.keyframe_interval_s", "0", "must be in [0.1, 1000000] s"),
    ("coordinator.keyframe_interval_s", "5e6", "must be in [0.1, 1000000] s"),
    ("coordinator.staleness_s", "0", "must be in (0, 1000000] s, got 0.0"),
    ("coordinator.staleness_s", "1e9", "must be in (0, 1000000] s"),
    ("coordinator.max_message_bytes", "0", "must be in [65536, 2147483647] bytes, got 0"),
    ("coordinator.max_message_bytes", "2147483648", "must be in [65536, 2147483647] bytes"),
    ("coordinator.grace_s", "-1", "must be >= 0 s"),
    ("coordinator.rpc_rate_per_s", "-1", "must be >= 0 requests/s"),
    ("coordinator.rpc_burst", "0.5", "must be >= 1 requests, got 0.5"),
    ("coordinator.stream_message_rate_per_s", "-1", "must be >= 0 messages/s"),
    ("coordinator.stream_message_burst", "0", "must be >= 1 messages"),
    ("coordinator.max_queued_per_tenant", "-1", "must be >= 0 tasks"),
    ("coordinator.finished_retention_s", "-1", "must be >= 0 s"),
    ("coordinator.advisor_interval_s", "0", "must be >= 0.1 s, got 0.0"),
    ("coordinator.advisor_hook_timeout_s", "0", "must be > 0 s, got 0.0"),
    ("coordinator.gc_gen0_threshold", "-1", "must be in [0, 2147483647] allocations"),
    ("coordinator.gc_gen0_threshold", "2147483648", "must be in [0, 2147483647] allocations"),
    ("coordinator.advisor_hook", '"   "', "no command in '   '"),
    ("coordinator.advisor_hook", "'run \"x'", "not a command line (No closing quotation)"),
    ("coordinator.agent_listen", '"127.0.0.1:50051"', "is listen's address; each listener needs its own port"),
    ("coordinator.metrics_listen", '"127.0.0.1:50051"', "is listen's address"),
    ("coordinator.tls_client_ca_file", '"/etc/ca.pem"', "needs tls_cert_file and tls_key_file"),
    ("scheduler.queue_head_limit", "-1", "must be >= 0, got -1"),
    ("scheduler.lease_s", "0", "must be in (0, 100000000] s"),
    ("scheduler.lease_s", "1e10", "must be in (0, 100000000] s"),
    ("scheduler.max_lease_extend_s", "1e10", "must be in (0, 100000000] s"),
]


@pytest.mark.parametrize("key, value, fragment", _REFUSED, ids=[f"{k}={v}" for k, v, _ in _REFUSED])
def test_out_of_range_values_are_refused_at_load_naming_option_file_and_range(tmp_path: Path, key: str, value: str, fragment: str) -> None:
    table, _, option = key.partition(".")
    path = _write(tmp_path, f"[{table}]\n{option} = {value}\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, {}, {})
    err = info.value
    assert (err.option, err.source) == (key, f"file:{path}")
    assert fragment in err.message
    assert str(err).startswith(f"{path}: {key}: ")
    # the environment and flags go through the same checks
    env = next(o.env for s in SECTIONS for o in options(s) if o.key == key)
    text = value.strip("'\"") if value[0] in "'\"" and value.count(value[0]) == 2 else value
    with pytest.raises(ConfigError) as info:
        load_settings(None, {env: text}, {})
    assert info.value.option == key and info.value.source == f"env:{env}"


def test_a_cross_option_rule_blames_what_was_set(tmp_path: Path) -> None:
    # persist fits the default window but not the smaller one set in the file
    path = _write(tmp_path, "[coordinator]\nsignal_window = 5\n")
    assert load_settings(path, {}, {}).coordinator.signal_window == 5
    with pytest.raises(ConfigError) as info:
        load_settings(path, {"GPULB_PERSIST": "6"}, {})
    assert (info.value.option, info.value.source) == ("coordinator.persist", "env:GPULB_PERSIST")
    assert "must be <= signal_window (5), got 6" in info.value.message
    # a TLS key without its certificate: the option left out is named, and the file that set the other
    path = _write(tmp_path, "[coordinator]\ntls_key_file = '/etc/gpulb/key.pem'\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, {}, {})
    assert (info.value.option, info.value.source) == ("coordinator.tls_cert_file", f"file:{path}")
    assert "needed with tls_key_file" in info.value.message


# (table.option, value): the ends of each range, and values just inside them.
_ACCEPTED = [
    ("coordinator.heartbeat_interval_s", 0.1), ("coordinator.heartbeat_interval_s", 1e6),
    ("coordinator.remove_after_intervals", 1),
    ("coordinator.keyframe_interval_s", 0.1), ("coordinator.keyframe_interval_s", 1e6),
    ("coordinator.staleness_s", 0.001), ("coordinator.staleness_s", 1e6),
    ("coordinator.max_message_bytes", 65536), ("coordinator.max_message_bytes", 2**31 - 1),
    ("coordinator.grace_s", 0.0),
    ("coordinator.signal_window", 5), ("coordinator.signal_window", 1000),
    ("coordinator.ewma_alpha", 1e-6), ("coordinator.ewma_alpha", 1.0),
    ("coordinator.iqr_k", 1e-6), ("coordinator.z_max", 1e-6),
    ("coordinator.persist", 2), ("coordinator.persist", 30),
    ("coordinator.smoothing_tick_s", 0.001), ("coordinator.smoothing_tick_s", 1.0),
    ("coordinator.dispatch_interval_s", 0.001), ("coordinator.dispatch_interval_s", 60.0),
    ("coordinator.rpc_rate_per_s", 0.0), ("coordinator.rpc_burst", 1.0),
    ("coordinator.stream_message_rate_per_s", 0.0), ("coordinator.stream_message_burst", 1.0),
    ("coordinator.max_queued_per_tenant", 0), ("coordinator.finished_retention_s", 0.0),
    ("coordinator.advisor_interval_s", 0.1), ("coordinator.advisor_hook_timeout_s", 0.001),
    ("coordinator.gc_gen0_threshold", 0), ("coordinator.gc_gen0_threshold", 2**31 - 1),
    ("coordinator.state_synchronous", "FULL"),
    ("scheduler.queue_head_limit", 0), ("scheduler.lease_s", 1e8), ("scheduler.max_lease_extend_s", 1e8),
]


@pytest.mark.parametrize("key, value", _ACCEPTED, ids=[f"{k}={v}" for k, v in _ACCEPTED])
def test_range_ends_are_accepted_and_the_coordinator_takes_them(key: str, value: Any) -> None:
    from coordinator.server import Coordinator

    s = load_settings(None, {}, {key: value})
    table, _, option = key.partition(".")
    assert getattr(getattr(s, table), option) == value
    # what the start builds from them accepts them too (SignalBank, NodeLiveness, the advisor, ...)
    Coordinator(s.coordinator, s.scheduler, advisor_config=s.advisor, predictor_config=s.predictor,
                growth_config=s.memory_growth)


def test_state_synchronous_takes_any_case_and_stores_the_choice() -> None:
    s = load_settings(None, {"GPULB_STATE_SYNCHRONOUS": "full"}, {})
    assert s.coordinator.state_synchronous == "FULL"


def test_every_number_option_of_the_coordinator_declares_its_range() -> None:
    # a new numeric option must say what it accepts; and its default must be in it
    coordinator = next(s for s in SECTIONS if s.name == "coordinator")
    for opt in options(coordinator):
        if opt.type in (int, float):
            assert opt.bounds is not None, f"{opt.key} declares no range (ge/gt/le/lt in coordinator/config.py)"
            assert opt.default in opt.bounds, opt.key
    for section in SECTIONS:
        for opt in options(section):
            if opt.bounds is not None:
                assert opt.default in opt.bounds, opt.key


def test_range_ends_fit_what_they_are_sent_as() -> None:
    # heartbeat, keyframe and refresh periods go to agents as uint32 ms
    # (gateway.py); gRPC takes a C int message size; gc a C int threshold
    import gc

    from protos import telemetry_pb2 as pb

    by_key = {o.key: o for s in SECTIONS for o in options(s)}

    def high(key: str) -> float:
        return by_key[key].bounds.high

    pb.RegisterAck(
        heartbeat_interval_ms=int(high("coordinator.heartbeat_interval_s") * 1000),
        keyframe_interval_ms=int(high("coordinator.keyframe_interval_s") * 1000),
        refresh_interval_ms=max(100, int(high("coordinator.staleness_s") * 500)),
    )
    for key in ("coordinator.heartbeat_interval_s", "coordinator.keyframe_interval_s"):
        assert int(by_key[key].bounds.low * 1000) >= 1  # 0 ms would mean "keep your own" to the agent
    before = gc.get_threshold()
    try:
        gc.set_threshold(int(high("coordinator.gc_gen0_threshold")), before[1], before[2])
    finally:
        gc.set_threshold(*before)
    assert high("coordinator.max_message_bytes") == 2**31 - 1


def test_sighup_reload_refuses_a_bad_value_and_keeps_the_running_one(tmp_path: Path) -> None:
    # SIGHUP re-reads through load_settings: a zero dispatch interval (a
    # spinning core on a running coordinator) is refused and nothing changes
    from coordinator.main import _Daemon
    from coordinator.security import Security

    path = _write(tmp_path, "[coordinator]\nlisten = '127.0.0.1:0'\n")
    settings = load_settings(path, {}, {})
    daemon = _Daemon(settings, str(path), {}, Security(insecure=True))
    dispatcher = daemon.coordinator.dispatcher
    for bad in ("dispatch_interval_s = 0", "smoothing_tick_s = 0", "heartbeat_interval_s = 0", "ewma_alpha = 2"):
        path.write_text(f"[coordinator]\nlisten = '127.0.0.1:0'\n{bad}\n")
        daemon.reload()
        assert daemon.settings is settings, bad
        assert dispatcher.interval_s == 0.5 and daemon.coordinator.liveness.heartbeat_interval_s == 10.0
    path.write_text("[coordinator]\nlisten = '127.0.0.1:0'\ndispatch_interval_s = 0.25\n")
    daemon.reload()  # and a good one applies (the test can tell the difference)
    assert dispatcher.interval_s == 0.25 and daemon.settings.coordinator.dispatch_interval_s == 0.25


def test_a_reload_keeps_saying_what_still_needs_a_restart(tmp_path: Path) -> None:
    """restart_needed_for compares the file with what runs, not with the last
    reload: a listen address changed two reloads ago is still not the port
    bound, and the second reload's log had dropped it (QA pass 23)."""
    import structlog

    from coordinator.main import _Daemon
    from coordinator.security import Security

    path = _write(tmp_path, "[coordinator]\nlisten = '127.0.0.1:0'\n")
    daemon = _Daemon(load_settings(path, {}, {}), str(path), {}, Security(insecure=True))
    saved = structlog.get_config()
    try:
        path.write_text("[coordinator]\nlisten = '127.0.0.1:1'\n")
        with structlog.testing.capture_logs() as logs:
            daemon.reload()
        [first] = [e for e in logs if e["event"] == "configuration_reloaded"]
        assert first["restart_needed_for"] == ["coordinator.listen"]
        path.write_text("[coordinator]\nlisten = '127.0.0.1:1'\ngrace_s = 3.0\ndispatch_interval_s = 0.25\n")
        with structlog.testing.capture_logs() as logs:
            daemon.reload()
        [second] = [e for e in logs if e["event"] == "configuration_reloaded"]
        assert sorted(second["restart_needed_for"]) == ["coordinator.grace_s", "coordinator.listen"]
        assert list(second["changed"]) == ["coordinator.dispatch_interval_s"]
        path.write_text("[coordinator]\nlisten = '127.0.0.1:0'\ndispatch_interval_s = 0.25\n")
        with structlog.testing.capture_logs() as logs:
            daemon.reload()  # the file back to what runs: nothing waits for a restart
        [third] = [e for e in logs if e["event"] == "configuration_reloaded"]
        assert third["restart_needed_for"] is None
    finally:
        structlog.configure(**saved)


def test_a_token_file_the_coordinator_cannot_use_is_named_with_where_it_came_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """GPULB_TOKEN_FILE is the gpulb CLI's client token file and, as
    GPULB_<OPTION>, the coordinator's token_file too: exported for the CLI, it
    stopped `gpulb-coordinator --insecure` with "flags/environment:
    alice.token: not valid TOML", naming neither the variable nor the mix-up."""
    import os

    from coordinator import main as coordinator_main

    monkeypatch.setattr(coordinator_main, "configure_logging", lambda *a, **k: None)  # leave logging as the tests have it
    for name in [n for n in os.environ if n.startswith("GPULB_")]:
        monkeypatch.delenv(name)
    client_token = _write(tmp_path, "gpulb_Zm9vYmFyYmF6cXV4MTIzNDU2Nzg5MGFiY2RlZmdoaWo\n", "alice.token")

    def refused(*argv: str) -> str:
        assert coordinator_main.main(["--insecure", *argv]) == 2
        return capsys.readouterr().err

    monkeypatch.setenv("GPULB_TOKEN_FILE", str(client_token))
    err = refused()
    assert f"token_file (from the environment variable GPULB_TOKEN_FILE): {client_token}: not valid TOML" in err, err
    assert "the file looks like a client's bearer token (one line), not the coordinator's token digest file" in err
    assert "GPULB_TOKEN_FILE is also the gpulb CLI's client token file" in err and "--token-file" in err
    assert "env -u GPULB_TOKEN_FILE gpulb-coordinator" in err and "flags/environment" not in err

    monkeypatch.delenv("GPULB_TOKEN_FILE")
    err = refused("--token-file", str(client_token))
    assert f"token_file (from the flag --token-file): {client_token}: not valid TOML" in err, err
    assert "looks like a client's bearer token" in err and "GPULB_TOKEN_FILE" not in err

    digests = _write(tmp_path, '[tokens."sha256:00"]\nrole = "admin"\n', "tokens.toml")
    config = _write(tmp_path, f'[coordinator]\ntoken_file = "{digests}"\n')
    err = refused("--config", str(config))
    assert f"token_file (from token_file in the config file {config}): {digests}: tokens." in err, err
    assert "client's bearer token" not in err and "GPULB_TOKEN_FILE" not in err


def test_print_config_says_when_the_daemon_would_not_start(capsys) -> None:
    """--print-config showed a configuration and exited 0 though the daemon
    refused it (no TLS or tokens, and not insecure): now, as `nginx -t`, it
    prints the configuration and says why it would not start, exit 2. An
    insecure lab configuration passes, and the daemon's INSECURE_MODE
    warning does not end up in the printed configuration."""
    from coordinator import main as coordinator_main

    assert coordinator_main.main(["--print-config", "--listen", "127.0.0.1:9"]) == 2
    out, err = capsys.readouterr()
    assert "listen = \"127.0.0.1:9\"" in out
    assert "would not start" in err and "TLS certificate and key are required" in err
    assert coordinator_main.main(["--print-config", "--listen", "127.0.0.1:9", "--insecure"]) == 0
    out, err = capsys.readouterr()
    assert "INSECURE_MODE" not in out and err == ""
    assert tomllib.loads(out)["coordinator"]["insecure"] is True


def test_every_value_out_of_range_is_named_at_once(tmp_path) -> None:
    """QA pass 24 (upgrades): values an older release took and this one
    refuses (ranges tightened over time) were named one per start, so an
    upgrade was a restart loop fixed one value at a time. All are named now;
    a single one reads as before."""
    from coordinator import main as coordinator_main
    from coordinator.settings import ConfigError, ConfigErrors, load_settings

    path = tmp_path / "coordinator.toml"
    path.write_text("[coordinator]\ninsecure = true\nheartbeat_interval_s = 0.05\nsignal_window = 2000\n"
                    "[scheduler]\nlease_s = 0\n")
    with pytest.raises(ConfigErrors) as caught:
        load_settings(path, {}, {})
    names = [e.option for e in caught.value.errors]
    assert "coordinator.heartbeat_interval_s" in names and "coordinator.signal_window" in names
    assert len(names) >= 2 and all(n in str(caught.value) for n in names)
    assert caught.value.option == names[0]  # a ConfigError as before, for its first

    path.write_text("[coordinator]\ninsecure = true\nheartbeat_interval_s = 0.05\n")
    with pytest.raises(ConfigError) as single:
        load_settings(path, {}, {})
    assert not isinstance(single.value, ConfigErrors)
    assert str(single.value).endswith("coordinator.heartbeat_interval_s: " + single.value.message)
    assert coordinator_main.main(["--config", str(path), "--print-config"]) == 2
