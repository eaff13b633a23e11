"""The simulator's input: bad trace and cluster files, bad flags and values
the replay cannot take are refused before it runs, exit 2 with one line naming
the file, line and column (or the flag), never a traceback; and what the
command line adds around a replay (--saturate with --advisor, the reasons
tasks did not complete). Run through the real ``gpulb simulate`` /
``gpulb trace`` entry functions, on tiny files."""

from __future__ import annotations

import io
import json

import pytest

from scheduler.simulator import simulate_main, trace_main
from scheduler.traces import TraceFormatError, parse_trace

HEADER = "task_id,submit_s,duration_s,num_gpus,vram_mib,gpu_share,priority,kind"
GOOD_ROW = "a,0,100,1,1000,0.5,P1,training"
CLUSTER = "node_id,gpus,model\nn1,2,RTX 4090\n"


def files(tmp_path, trace: str | bytes, cluster: str = CLUSTER):
    t, c = tmp_path / "t.csv", tmp_path / "c.csv"
    if isinstance(trace, bytes):
        t.write_bytes(trace)
    else:
        t.write_text(trace)
    c.write_text(cluster)
    return t, c


def run_cli(main, argv, capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``main(argv)``, argparse's exits included."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def simulate(tmp_path, capsys, trace, *flags, cluster=CLUSTER):
    t, c = files(tmp_path, trace, cluster)
    return run_cli(simulate_main, ["--trace", str(t), "--cluster", str(c), "--policy", "load_aware",
                                   "--memory", "asked", "--no-progress", *flags], capsys)


# ---- bad traces: refused at reading, naming the line and column --------------------------------


@pytest.mark.parametrize(
    ("rows", "where", "fragment"),
    [
        # huge times hung the replay (1e308), overflowed its arithmetic or outlived its leases (1e12)
        ("a,0,1e308,1,1000,0.5,P1,training", "t.csv:2: column 'duration_s'", "at most 1e+09"),
        ("a,0,1e12,1,1000,0.5,P1,training", "t.csv:2: column 'duration_s'", "at most 1e+09"),
        ("a,1e308,100,1,1000,0.5,P1,training", "t.csv:2: column 'submit_s'", "at most 1e+09"),
        # past TaskSpec's limits: read, then an InvalidTask traceback in the replay
        ("a,0,100,1,1000,0.5,P1," + "k" * 65, "t.csv:2: column 'kind'", "longer than 64 characters"),
        ('a,0,100,1,1000,0.5,P1,"x\ny"', "t.csv:2: column 'kind'", "contains control characters"),
        # a quoted value spanning lines is one record: the bad row after it is on line 5
        ('a,"0\n",100,1,1000,0.5,P1,training\n\nb,0,100,1,1000,0.5,P1', "t.csv:5:", "expected 8 fields, got 7"),
    ],
)
def test_bad_trace_rows(tmp_path, capsys, rows, where, fragment):
    code, out, err = simulate(tmp_path, capsys, f"{HEADER}\n{rows}\n")
    assert code == 2 and out == ""
    assert err.startswith("gpulb simulate: ") and err.count("\n") == 1
    assert where in err and fragment in err


def test_bad_optional_columns(tmp_path, capsys):
    code, _, err = simulate(tmp_path, capsys, f"{HEADER},tenant\n{GOOD_ROW},{'t' * 129}\n")
    assert code == 2 and "t.csv:2: column 'tenant': longer than 128 characters" in err
    code, _, err = simulate(tmp_path, capsys, f"{HEADER},estimate_s\n{GOOD_ROW},1e12\n")
    assert code == 2 and "t.csv:2: column 'estimate_s': expected at most 1e+09" in err


def test_line_numbers_count_every_line_of_a_record_that_spans_lines():
    text = (f'{HEADER}\n# a note\na,0,100,1,1000,0.5,P1,training\nb,"1\n\n",100,1,1000,0.5,P1,batch\n'
            '\nc,x,1,1,1,1,P1,x\n')
    with pytest.raises(TraceFormatError) as info:
        parse_trace(io.StringIO(text, newline=""), source="t.csv")
    assert (info.value.line, info.value.column) == (8, "submit_s")
    # a line starting with '#' inside a quoted value is part of it, not a comment
    with pytest.raises(TraceFormatError) as info:
        parse_trace(io.StringIO(f'{HEADER}\na,"1\n#",100,1,1000,0.5,P1,x\n', newline=""), source="t.csv")
    assert (info.value.line, info.value.column) == (2, "submit_s")
    assert "got '1\\n#'" in str(info.value)


def test_a_header_and_no_rows_is_refused_up_front(tmp_path, capsys):
    # was: the replay of nothing, then 'ValueError: no tasks' from --saturate
    code, out, err = simulate(tmp_path, capsys, f"{HEADER}\n# nothing yet\n", "--saturate")
    assert code == 2 and out == ""
    assert "t.csv: no tasks" in err


def test_utf8_bom_reads_and_other_encodings_name_the_file(tmp_path, capsys):
    # Excel's "CSV UTF-8" starts with a byte-order mark: was "column '\ufefftask_id': unknown column"
    code, out, err = simulate(tmp_path, capsys, f"\ufeff{HEADER}\n{GOOD_ROW}\n".encode("utf-8"), "--json",
                              cluster="\ufeff" + CLUSTER)
    assert code == 0, err
    assert json.loads(out)["policies"][0]["completed"] == 1
    # Latin-1: was "'utf-8' codec can't decode byte 0xff in position ..." naming no file
    code, out, err = simulate(tmp_path, capsys, f"{HEADER}\n{GOOD_ROW}\nb,0,1,1,1,0.5,P1,caf\xe9\n".encode("latin-1"))
    assert code == 2 and out == ""
    assert "t.csv:3: not UTF-8 text (byte 0xe9)" in err


# ---- bad clusters ---------------------------------------------------------------------------------


@pytest.mark.parametrize("speed", ["1e-300", "1e-4", "1e4"])
def test_cluster_speed_out_of_range(tmp_path, capsys, speed):
    # 1e-300 ran every task past the simulator's 1e12 s lease: NotLeaseHolder traceback
    code, out, err = simulate(tmp_path, capsys, f"{HEADER}\n{GOOD_ROW}\n",
                              cluster=f"node_id,gpus,model,speed\nn1,2,RTX 4090,{speed}\n")
    assert code == 2 and out == ""
    assert "c.csv:2: column 'speed'" in err


# ---- what a replay can take, after the flags ------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "flags", "cluster", "fragment"),
    [
        # openb's longest run at --time-scale 1e-6: a NotLeaseHolder traceback
        ("a,0,12537496,1,1000,0.5,P1,training", ["--time-scale", "1e-6"], CLUSTER,
         "--time-scale 1e-06: task 'a' would run 1.25375e+13 s"),
        ("a,100,10,1,1000,0.5,P1,training", ["--arrival-scale", "1e-9"], CLUSTER,
         "--arrival-scale 1e-09: task 'a' would be submitted at 1e+11 s"),
        # each value in range, together past the lease: 1e9 s on a speed-0.001 node
        ("a,0,1e9,1,1000,0.5,P1,training", [], "node_id,gpus,model,speed\nslow,1,T4,0.001\n",
         "task 'a' would run 1e+12 s alone on the slowest node, 'slow'"),
    ],
)
def test_scaled_times_beyond_the_replay(tmp_path, capsys, rows, flags, cluster, fragment):
    code, out, err = simulate(tmp_path, capsys, f"{HEADER}\n{rows}\n", *flags, cluster=cluster)
    assert code == 2 and out == ""
    assert fragment in err


def test_a_run_slowed_past_the_lease_by_sharing_is_one_line(tmp_path, capsys):
    # 150 tasks of 100 % on one GPU: each alone within the limit, together 150 times slower
    rows = "\n".join(f"t{i},0,9e8,1,1,0.01,P2,batch,100" for i in range(150))
    code, out, err = simulate(tmp_path, capsys, f"{HEADER},util\n{rows}\n", "--policy", "round_robin",
                              cluster="node_id,gpus,model,speed\nn1,1,RTX 4090,0.1\n")
    assert code == 2 and out == ""
    assert "ran past the simulator's 1e+12 s lease" in err


# ---- bad flags: argparse's exit 2 naming the flag -------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--seed", "-1"], "argument --seed: expected an integer >= 0"),  # numpy's ValueError
        (["--estimate-noise", "1e5"], "argument --estimate-noise: expected a number in [0, 10]"),  # OverflowError
        (["--estimate-scale", "1e308"], "argument --estimate-scale: expected a number in [0, 1000]"),  # InvalidTask
        (["--max-tasks", "-5"], "argument --max-tasks: expected an integer >= 1"),  # replayed everything
        (["--max-tasks", "0"], "argument --max-tasks: expected an integer >= 1"),
        (["--advisor-set", "nope=1"], "--advisor-set needs --advisor"),  # silently ignored
        (["--load-drift", "1e6"], "argument --load-drift: expected a number in [0, 10]"),  # numpy RuntimeWarning
        (["--migration-cost", "1e300", "--advisor"], "argument --migration-cost: expected a number in [0, 1e+09]"),
        (["--time-scale", "1e-200", "--arrival-scale", "1e-200"], "is out of range"),  # ZeroDivisionError
        (["--time-scale", "1e300"], "argument --time-scale: expected a number > 0 and at most 1e+06"),  # absurd figures
        (["--arrival-scale", "1e7"], "argument --arrival-scale: expected a number > 0 and at most 1e+06"),
    ],
)
def test_bad_flags(tmp_path, capsys, flags, fragment):
    code, out, err = simulate(tmp_path, capsys, f"{HEADER}\n{GOOD_ROW}\n", *flags)
    assert code == 2 and out == ""
    assert fragment in err


def test_scheduler_set_offers_only_what_it_takes(tmp_path, capsys):
    """An unknown --scheduler-set option listed the [scheduler] table's every
    option, policy and lease_s among them, which it then refused as set by
    the simulator: the list leaves them out, and each refusal says why."""
    code, out, err = simulate(tmp_path, capsys, f"{HEADER}\n{GOOD_ROW}\n", "--scheduler-set", "nonsense=1")
    assert code == 2 and out == ""
    offered = err.split("expected OPTION=VALUE with OPTION one of ", 1)[1].strip().split(", ")
    assert "growth_room_wait_s" in offered and "policy" not in offered and "lease_s" not in offered, err
    for option, why in (("policy=binpack", "set by the simulator (use --policy)"),
                        ("lease_s=60", "set by the simulator (simulated leases never expire)")):
        code, out, err = simulate(tmp_path, capsys, f"{HEADER}\n{GOOD_ROW}\n", "--scheduler-set", option)
        assert code == 2 and f"--scheduler-set: {option!r}: {why}" in err, err
    code, out, err = simulate(tmp_path, capsys, f"{HEADER}\n{GOOD_ROW}\n", "--scheduler-set", "growth_room_wait_s")
    assert code == 2 and "'growth_room_wait_s': expected OPTION=VALUE" in err, err


def test_max_tasks_replays_that_many(tmp_path, capsys):
    rows = "\n".join(f"t{i},{i},10,1,1000,0.5,P2,batch" for i in range(5))
    code, out, _ = simulate(tmp_path, capsys, f"{HEADER}\n{rows}\n", "--max-tasks", "2", "--json")
    assert code == 0 and json.loads(out)["policies"][0]["tasks"] == 2
    # 0 replayed every task, as no --max-tasks does
    code, out, err = simulate(tmp_path, capsys, f"{HEADER}\n{rows}\n", "--max-tasks", "0", "--json")
    assert code == 2 and "argument --max-tasks" in err


@pytest.mark.parametrize("kind", ["file", "under_file"])
def test_a_bad_plot_folder_is_refused_before_the_replay(tmp_path, capsys, kind):
    blocker = tmp_path / "plots"
    blocker.write_text("a file\n")
    target = blocker if kind == "file" else blocker / "sub"
    code, out, err = simulate(tmp_path, capsys, f"{HEADER}\n{GOOD_ROW}\n", "--plot", str(target))
    assert code == 2
    assert out == ""  # no table: refused before the replay, not after it
    assert f"--plot {target}:" in err
    # a folder that can be made is, before the replay (with or without matplotlib)
    target = tmp_path / "new" / "plots"
    code, _, _ = simulate(tmp_path, capsys, f"{HEADER}\n{GOOD_ROW}\n", "--plot", str(target))
    assert code == 0 and target.is_dir()


# ---- --saturate with --advisor, and why tasks did not complete -------------------------------------


def test_saturate_with_advisor(tmp_path, capsys):
    # was: ValueError: unknown policy 'load_aware+advisor' after the whole replay
    rows = "a,0,100,1,8000,0.5,P1,training\nb,5,100,1,8000,0.5,P2,batch\nc,10,50,1,4000,0.2,P0,inference"
    code, out, err = simulate(tmp_path, capsys, f"{HEADER}\n{rows}\n", "--advisor", "--saturate", "--json")
    assert code == 0, err
    by = {p["policy"]: p for p in json.loads(out)["policies"]}
    assert set(by) == {"load_aware", "load_aware+advisor"}
    # no advisor acts in the saturation run (tasks never end): the same measure
    sat = by["load_aware"]["saturation"]
    assert sat["placed"] > 0
    assert by["load_aware+advisor"]["saturation"]["placed"] == sat["placed"]


REJECTED = (
    f"{HEADER},gpu_spec,needs_nvlink\n"
    "ok,0,10,1,1000,0.5,P1,training,,\n"
    "spec,0,10,1,1000,0.5,P1,training,A100,\n"
    "big,0,10,4,1000,0.5,P1,training,,\n"
    "nv,0,10,1,1000,0.5,P1,training,,true\n"
    "spec2,1,10,1,1000,0.5,P1,training,A100,\n"
)


def test_reasons_table_after_the_summary(tmp_path, capsys):
    code, out, _ = simulate(tmp_path, capsys, REJECTED, "--policy", "load_aware,round_robin")
    assert code == 0
    summary = next(line for line in out.splitlines() if line.startswith("dropped / rejected / unfinished"))
    assert summary.split()[-2:] == ["0/4/0", "0/4/0"]
    table = out[out.index("tasks not completed, by reason"):]
    assert "(count: load_aware / round_robin; e.g. task ids)" in table
    lines = table.splitlines()[1:]
    spec = next(line for line in lines if "gpu_spec 'A100'" in line)
    assert spec.split()[:2] == ["rejected", "2/2"] and spec.endswith("(e.g. spec, spec2)")
    assert any("num_gpus 4 exceeds every node" in line and line.endswith("(e.g. big)") for line in lines)
    assert any("NVLink" in line and line.endswith("(e.g. nv)") for line in lines)
    # every task completed: no table
    code, out, _ = simulate(tmp_path, capsys, f"{HEADER}\n{GOOD_ROW}\n")
    assert code == 0 and "tasks not completed" not in out


def test_reasons_in_json(tmp_path, capsys):
    code, out, _ = simulate(tmp_path, capsys, REJECTED, "--json")
    assert code == 0
    (fig,) = json.loads(out)["policies"]
    nc = fig["not_completed"]
    assert sum(nc["by_reason"]["rejected"].values()) == 4
    assert nc["by_reason"]["rejected"]["no GPU matches gpu_spec 'A100' (models: NVIDIA GeForce RTX 4090)"] == 2
    by_task = {t["task_id"]: t for t in nc["tasks"]}
    assert set(by_task) == {"spec", "big", "nv", "spec2"}
    assert by_task["big"]["state"] == "rejected" and "num_gpus 4" in by_task["big"]["reason"]


# ---- gpulb trace convert ----------------------------------------------------------------------------

PODS = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
    "p0,1,1,1,500,,LS,Succeeded,10,110,20\n"
)


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--times-from", "/nope/pods.csv"], "--times-from /nope/pods.csv: no such file"),  # exit 0, silently
        (["--seed", "-3"], "argument --seed: expected an integer >= 0"),  # accepted
        (["--time-scale", "1e-8"], "pods.csv:2: column 'deletion_time': duration 9e+09 s"),  # an unreadable trace
    ],
)
def test_trace_convert_refuses(tmp_path, capsys, flags, fragment):
    pods = tmp_path / "pods.csv"
    pods.write_text(PODS)
    out_csv = tmp_path / "trace.csv"
    code, _, err = run_cli(trace_main, ["trace", "convert", "openb", str(pods), str(out_csv), *flags], capsys)
    assert code == 2
    assert fragment in err
    assert not out_csv.exists()


def test_trace_convert_reads_a_bom(tmp_path, capsys):
    pods = tmp_path / "pods.csv"
    pods.write_text("\ufeff" + PODS)
    out_csv = tmp_path / "trace.csv"
    code, _, err = run_cli(trace_main, ["trace", "convert", "openb", str(pods), str(out_csv)], capsys)
    assert code == 0, err
    assert out_csv.read_text().splitlines()[1] == "p0,0,90,1,6144,0.5,P0,inference"


def test_a_closed_pipe_ends_gpulb_simulate_quietly(tmp_path):
    """`gpulb simulate ... | head` ended in a BrokenPipeError traceback; the
    offline commands now leave as the others do (no traceback, the CLI's
    broken-pipe status)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from coordinator.cli import EXIT_BROKEN_PIPE

    t, c = files(tmp_path, HEADER + "\n" + GOOD_ROW + "\n")
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "coordinator.cli", "simulate", "--trace", str(t), "--cluster", str(c),
                               "--policy", "load_aware", "--memory", "asked", "--no-progress"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120,
                              cwd=Path(__file__).resolve().parents[1])
    finally:
        os.close(write_end)
    assert done.returncode == EXIT_BROKEN_PIPE and "Traceback" not in done.stderr, done.stderr
