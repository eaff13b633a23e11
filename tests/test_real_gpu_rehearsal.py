"""benchmarks/real_gpu.py, rehearsed without a GPU (simulated backend, a load
that only sleeps): the script a GPU host runs must not rot between the
sessions that have one. Real processes on loopback, as on the GPU."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_real_gpu_script_runs_end_to_end_on_the_simulator(tmp_path: Path) -> None:
    out = tmp_path / "rg"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "real_gpu.py"), "--rehearse", "--out", str(out),
         "--calm-s", "1", "--load-s", "2", "--load-gib", "16"],
        capture_output=True, text=True, timeout=110, cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((out / "real_gpu.json").read_text())
    assert summary["check"]["ok"] is True and summary["check"]["backend"] == "sim"
    assert [p["phase"] for p in summary["phases"]] == ["calm", "load", "calm after"]
    assert all(p["period_ms_last"] in range(200, 2001) for p in summary["phases"])
    assert all(p["reading_age_s_max"] is not None and p["reading_age_s_max"] < 10 for p in summary["phases"])
    fits = summary["tasks"]["fits-beside-load"]
    assert fits["state"] == "TASK_STATE_LEASED" and fits["gpu"] == "gpu-host/[0]"
    assert summary["exit_codes"] == {"coordinator": 0, "agent": 0}
    with open(out / "timeline.csv") as fh:
        sources = {row["source"] for row in csv.DictReader(fh)}
    assert "coordinator" in sources
    assert (out / "coordinator.log").exists() and (out / "agent.log").exists()
    assert "PERIOD ms" in run.stdout and "READING AGE MAX s" in run.stdout
