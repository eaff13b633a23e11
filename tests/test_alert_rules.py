"""The alerting rules and the Grafana dashboard use only metrics the coordinator
exports, parse as PromQL, and (with promtool) fire on the cases they are for."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest

from prometheus_client import Histogram

from coordinator.metrics import EXPORTED_METRIC_NAMES, CoordinatorMetrics

SYSTEMD = Path(__file__).resolve().parent.parent / "systemd"
RULES = SYSTEMD / "alerts.yml"
RULE_TESTS = SYSTEMD / "alerts_test.yml"
DASHBOARD = SYSTEMD / "grafana-dashboard.json"

_METRIC = re.compile(r"\bgpulb_[a-z0-9_]+")
# Series a histogram family exposes besides its own name.
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian/Ubuntu: apt-get install prometheus)"
)


def _histograms() -> set[str]:
    # The histogram families, read off the coordinator's real instruments (a
    # registry with no coordinator behind it: its view collector runs only on
    # scrape), so only they may be used with _bucket/_sum/_count.
    metrics = CoordinatorMetrics(None)  # type: ignore[arg-type]
    return {m.name for inst in vars(metrics).values() if isinstance(inst, Histogram) for m in inst.describe()}


HISTOGRAMS = _histograms()


def unknown_metrics(text: str) -> set[str]:
    """``gpulb_*`` names in ``text`` that the coordinator does not export."""
    exported = set(EXPORTED_METRIC_NAMES)
    unknown = set()
    for name in _METRIC.findall(text):
        if name in exported:
            continue
        if any(name.endswith(s) and name[: -len(s)] in HISTOGRAMS for s in _HISTOGRAM_SUFFIXES):
            continue
        unknown.add(name)
    return unknown


def test_histograms_are_exported() -> None:
    assert HISTOGRAMS and HISTOGRAMS <= set(EXPORTED_METRIC_NAMES)
    assert "gpulb_ingest_latency_seconds" in HISTOGRAMS


@pytest.mark.parametrize(
    "text, expected",
    [
        ("rate(gpulb_resyncs_total[5m])", set()),
        ("histogram_quantile(0.9, rate(gpulb_ingest_latency_seconds_bucket[5m]))", set()),
        ("gpulb_task_wait_seconds_sum / gpulb_task_wait_seconds_count", set()),
        ("gpulb_gpu_utilisation_ratio > 0.9", {"gpulb_gpu_utilisation_ratio"}),
        ("gpulb_nodes_bucket", {"gpulb_nodes_bucket"}),  # a gauge has no buckets
        ("gpulb_queue_depth_total", {"gpulb_queue_depth_total"}),
    ],
)
def test_metric_name_check_catches_unknown_names(text: str, expected: set[str]) -> None:
    assert unknown_metrics(text) == expected


# ---- alerting rules ----------------------------------------------------------------------


def test_rules_use_only_exported_metrics() -> None:
    # The whole file, annotations included: a name in a description that does
    # not exist misleads the operator reading the page as much as a bad expr.
    text = RULES.read_text()
    assert _METRIC.findall(text), "no gpulb metric found: the regex or the file is wrong"
    assert unknown_metrics(text) == set()


def test_the_commands_the_rules_tell_an_operator_to_run_exist() -> None:
    """Every `gpulb ...` in backticks or parentheses in alerts.yml parses
    with the CLI as written (NODE standing for a node id): an alert that
    sends the operator to `gpulb policies` or `gpulb processes NODE` (both
    refused) costs minutes in an incident."""
    from coordinator.cli import build_parser

    # the annotations (not the comments), folded as YAML folds them
    text = " ".join(line.strip() for line in RULES.read_text().splitlines() if not line.strip().startswith("#"))
    commands = re.findall(r"[`(]gpulb ([a-z][^`()]*)[`)]", text)
    assert len(commands) >= 5, commands
    parser = build_parser()
    for command in commands:
        try:
            parser.parse_args(command.replace("NODE", "gpu-01").split())
        except SystemExit:
            pytest.fail(f"alerts.yml tells the operator to run `gpulb {command}`, which gpulb refuses")


def test_rules_cover_the_operational_cases() -> None:
    alerts = set(re.findall(r"^\s*- alert: (\w+)\s*$", RULES.read_text(), re.M))
    assert {
        "GpulbGpuHotWhileOthersIdle",
        "GpulbNodeUnreachable",
        "GpulbStaleTelemetry",
        "GpulbP0SlaMisses",
        "GpulbQueueGrowing",
        "GpulbTelemetryResyncStorm",
    } <= alerts
    # Every alert has a unit test case in alerts_test.yml that expects it to fire.
    tested = set(re.findall(r"^\s*alertname: (\w+)\s*$", RULE_TESTS.read_text(), re.M))
    untested = alerts - tested - {"GpulbNodesRemoved", "GpulbEnvelopesRejected", "GpulbIngestSlow"}
    assert untested == set()


@needs_promtool
def test_promtool_check_rules() -> None:
    result = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_promtool_rule_unit_tests() -> None:
    # The alerts fire (and stay quiet) on synthetic series, annotations included.
    result = subprocess.run(
        [PROMTOOL, "test", "rules", RULE_TESTS.name], cwd=SYSTEMD, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_check_rules_rejects_a_bad_expression(tmp_path: Path) -> None:
    # The check above can fail: a broken expression is refused.
    bad = tmp_path / "bad.yml"
    bad.write_text("groups:\n  - name: x\n    rules:\n      - alert: X\n        expr: rate(gpulb_resyncs_total[5m]) >\n")
    result = subprocess.run([PROMTOOL, "check", "rules", str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0


# ---- dashboard ------------------------------------------------------------------------------


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dash["panels"]:
        yield panel
        yield from panel.get("panels", [])


def _expressions(dash: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in _panels(dash) for t in p.get("targets", []) if "expr" in t]
    for var in dash.get("templating", {}).get("list", []):
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if var.get("type") == "query" and query:
            exprs.append(query)
    return exprs


def test_dashboard_uses_only_exported_metrics() -> None:
    exprs = _expressions(_dashboard())
    assert len(exprs) > 10
    assert unknown_metrics("\n".join(exprs)) == set()
    assert unknown_metrics(DASHBOARD.read_text()) == set()


def test_dashboard_has_the_panels_operators_need() -> None:
    dash = _dashboard()
    panels = [p for p in _panels(dash) if p["type"] != "row"]
    by_title = {p["title"]: p for p in panels}
    exprs_of = {t: " ".join(x["expr"] for x in p["targets"]) for t, p in by_title.items()}
    # heat map of utilisation by node/GPU over time
    heat = by_title["GPU utilisation heat map (node/GPU over time)"]
    assert "gpulb_gpu_utilization" in exprs_of[heat["title"]] and "{{node}}/{{gpu}}" in heat["targets"][0]["legendFormat"]
    # balance: stddev and max - min of utilisation
    spread = exprs_of["Utilisation spread across GPUs"]
    assert "stddev(" in spread and "max(" in spread and "min(" in spread
    # queue by class, ingest rate and latency
    assert "sum by (priority) (gpulb_queue_depth)" in exprs_of["Queue depth by class"]
    assert "gpulb_envelopes_received_total" in exprs_of["Ingest rate"]
    assert "gpulb_ingest_latency_seconds_bucket" in exprs_of["Ingest latency"]
    # what the learners learned: memory growth per kind, prediction error
    assert "gpulb_memory_growth_ratio" in exprs_of["Memory growth: peak over ask, by kind"]
    assert "gpulb_predictor_mape_ratio" in exprs_of["Run-time prediction"]
    # whether tasks wait for a card with room to grow, and whether they find one
    assert "gpulb_growth_room_waits_total" in exprs_of["Waits for a GPU with room to grow, by outcome"]
    # the fleet by driver and agent release (a rollout's progress, the odd host out)
    assert "count by (driver, agent_version) (gpulb_node_info)" in exprs_of["Hosts by NVIDIA driver and agent release"]
    # well-formed: unique ids, a datasource and a query on every panel, within the 24-column grid
    ids = [p["id"] for p in _panels(dash)]
    assert len(ids) == len(set(ids))
    for p in panels:
        assert p["targets"] and all(t.get("expr") for t in p["targets"]), p["title"]
        assert p["datasource"]["uid"] == "${datasource}"
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24
    used_vars = set(re.findall(r"\$(\w+)", json.dumps([p["targets"] for p in panels])))
    defined = {v["name"] for v in dash["templating"]["list"]}
    assert used_vars - {"__rate_interval", "__range"} <= defined


def test_dashboard_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for p in _panels(_dashboard()):
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]


@needs_promtool
def test_dashboard_queries_parse_as_promql(tmp_path: Path) -> None:
    # promtool has no bare-expression check, so each query becomes a recording
    # rule, with Grafana's variables replaced by values they take at run time.
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for i, expr in enumerate(_expressions(_dashboard())):
        if expr.startswith("label_values("):
            expr = expr.split("(", 1)[1].split(",", 1)[0]  # label_values(metric, label): the metric must parse
        concrete = expr.replace("$__rate_interval", "5m").replace("$__range", "1h").replace("$node", ".*")
        lines += [f"      - record: dashboard:query_{i}", f"        expr: {json.dumps(concrete)}"]
    rules = tmp_path / "dashboard_rules.yml"
    rules.write_text("\n".join(lines) + "\n")
    result = subprocess.run([PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
