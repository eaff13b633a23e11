"""Trace and cluster files: the reader's errors, round trips, and the openb
converters' mapping on literal rows."""

from __future__ import annotations

import io
import math

import pytest

from scheduler.cluster import (
    KNOWN_MODELS,
    ClusterNode,
    convert_openb_nodes,
    homogeneous,
    lookup_model,
    node_facts,
    nvlink_pairs,
    parse_cluster,
    read_cluster,
    write_cluster,
)
from scheduler.gpuspec import gpu_spec_mask
from scheduler.snapshot import ClusterSnapshot
from scheduler.task import Priority
from scheduler.traces import (
    OPENB_REFERENCE_VRAM_MIB,
    OPENB_VRAM_FRACTION,
    TraceFormatError,
    TraceTask,
    convert_openb,
    convert_openb_rows,
    misestimate,
    parse_trace,
    read_trace,
    scale_trace,
    trace_to_text,
    write_trace,
)

HEADER = "task_id,submit_s,duration_s,num_gpus,vram_mib,gpu_share,priority,kind"


def parse(text: str) -> list[TraceTask]:
    return parse_trace(io.StringIO(text), source="t.csv")


# ---- the trace format ---------------------------------------------------------------


def test_minimal_trace_reads_with_defaults():
    tasks = parse(f"{HEADER}\na,0,10,1,1000,0.5,P1,inference\n")
    (t,) = tasks
    assert t == TraceTask("a", 0.0, 10.0, 1, 1000.0, 0.5, Priority.P1, "inference")
    assert t.util_pct == 50.0
    assert t.is_movable is False
    spec = t.to_spec()
    assert spec.task_id == "a" and spec.vram_mib == 1000.0 and spec.priority == Priority.P1
    assert spec.duration_s == 10.0


def test_optional_columns_comments_and_any_column_order():
    text = (
        "# a comment line\n"
        "kind,priority,gpu_share,vram_mib,num_gpus,duration_s,submit_s,task_id,util,movable,gpu_spec,tenant\n"
        "\n"
        "training,2,1,20000,2,3600,5,b,80,false,V100M16|V100M32,team-a\n"
        "batch,P3,0.25,4000,1,60,6,c,,,,\n"
    )
    b, c = parse(text)
    assert (b.task_id, b.num_gpus, b.priority, b.util_pct, b.movable, b.gpu_spec, b.tenant) == (
        "b", 2, Priority.P2, 80.0, False, "V100M16|V100M32", "team-a"
    )
    assert b.is_movable is False  # explicit false beats kind "training"
    assert c.util is None and c.util_pct == 25.0 and c.is_movable is True  # batch moves


@pytest.mark.parametrize(
    ("row", "line", "column", "fragment"),
    [
        ("a,x,10,1,1000,0.5,P1,inference", 2, "submit_s", "expected a number"),
        ("a,-1,10,1,1000,0.5,P1,inference", 2, "submit_s", "[0, inf)"),
        ("a,0,0,1,1000,0.5,P1,inference", 2, "duration_s", "(0, inf)"),
        ("a,0,nan,1,1000,0.5,P1,inference", 2, "duration_s", "finite"),
        ("a,0,10,0,1000,0.5,P1,inference", 2, "num_gpus", "1..64"),
        ("a,0,10,1.5,1000,0.5,P1,inference", 2, "num_gpus", "integer"),
        ("a,0,10,1,0,0.5,P1,inference", 2, "vram_mib", "(0, inf)"),
        ("a,0,10,1,1000,1.5,P1,inference", 2, "gpu_share", "[0, 1]"),
        ("a,0,10,1,1000,0.5,P7,inference", 2, "priority", "P0..P3"),
        ("a,0,10,1,1000,0.5,P1", 2, None, "expected 8 fields, got 7"),
        (",0,10,1,1000,0.5,P1,inference", 2, "task_id", "must not be empty"),
    ],
)
def test_reader_errors_name_line_and_column(row, line, column, fragment):
    with pytest.raises(TraceFormatError) as info:
        parse(f"{HEADER}\n{row}\n")
    err = info.value
    assert (err.line, err.column) == (line, column)
    assert fragment in str(err)
    assert str(err).startswith(f"t.csv:{line}")


def test_reader_errors_on_later_rows_count_lines_from_the_file():
    text = f"{HEADER}\n# note\na,0,10,1,1000,0.5,P1,inference\n\nb,0,10,1,1000,0.5,P1,inference\na,1,1,1,1,1,P0,x\n"
    with pytest.raises(TraceFormatError) as info:
        parse(text)
    assert info.value.line == 6 and info.value.column == "task_id"
    assert "duplicate task_id 'a' (first on line 3)" in str(info.value)


def test_header_errors():
    with pytest.raises(TraceFormatError, match="required column is missing"):
        parse("task_id,submit_s\na,0\n")
    with pytest.raises(TraceFormatError, match="unknown column") as info:
        parse(f"{HEADER},utl\n")
    assert info.value.column == "utl"
    with pytest.raises(TraceFormatError, match="appears twice"):
        parse(f"{HEADER},kind\n")
    with pytest.raises(TraceFormatError, match="empty file"):
        parse("# only a comment\n")


def test_bad_optional_values():
    head = HEADER + ",util,movable,gpu_spec"
    with pytest.raises(TraceFormatError) as info:
        parse(f"{head}\na,0,10,1,1000,0.5,P1,x,101,,\n")
    assert info.value.column == "util"
    with pytest.raises(TraceFormatError) as info:
        parse(f"{head}\na,0,10,1,1000,0.5,P1,x,,maybe,\n")
    assert info.value.column == "movable"
    with pytest.raises(TraceFormatError) as info:
        parse(f"{head}\na,0,10,1,1000,0.5,P1,x,,,V100|\n")
    assert info.value.column == "gpu_spec"
    with pytest.raises(TraceFormatError) as info:
        parse(f"{HEADER},needs_nvlink\na,0,10,2,1000,0.5,P1,x,linked\n")
    assert info.value.column == "needs_nvlink" and "true/false" in str(info.value)


def test_write_then_read_is_the_same(tmp_path):
    tasks = [
        TraceTask("a", 0.0, 12.5, 1, 6029.3, 0.46, Priority.P0, "inference"),
        TraceTask("b", 1.0 / 3.0, 7200.0, 8, 13107.2, 1.0, Priority.P3, "background",
                  gpu_spec="G2|T4", tenant="t", util=33.3, movable=True),
        TraceTask("c", 2.0, 60.0, 4, 70_000.0, 1.0, Priority.P0, "inference", needs_nvlink=True),
    ]
    path = tmp_path / "trace.csv"
    write_trace(tasks, path)
    assert read_trace(path) == tasks
    assert tasks[2].to_spec().needs_nvlink and not tasks[0].to_spec().needs_nvlink
    # optional columns are written only when used
    assert trace_to_text(tasks[:1]).splitlines()[0] == HEADER


def test_scale_trace_compresses_time():
    t = TraceTask("a", 100.0, 50.0, 1, 1.0, 1.0, Priority.P0, "x")
    (s,) = scale_trace([t], time_scale=10.0)
    assert (s.submit_s, s.duration_s) == (10.0, 5.0)
    (s,) = scale_trace([t], arrival_scale=4.0)
    assert (s.submit_s, s.duration_s) == (25.0, 50.0)
    with pytest.raises(ValueError, match="time_scale"):
        scale_trace([t], time_scale=0.0)


def test_estimate_column_is_what_the_scheduler_is_told():
    """``estimate_s`` is the client's estimate, passed as the spec's
    duration_s; empty is an exact estimate, 0 none at all; the run time the
    simulator replays stays ``duration_s``."""
    a, b, c = parse(f"{HEADER},estimate_s\na,0,100,1,1000,0.5,P1,x,30\nb,0,100,1,1000,0.5,P1,x,\nc,0,100,1,1000,0.5,P1,x,0\n")
    assert (a.to_spec().duration_s, b.to_spec().duration_s, c.to_spec().duration_s) == (30.0, 100.0, 0.0)
    assert a.duration_s == b.duration_s == c.duration_s == 100.0
    with pytest.raises(TraceFormatError) as info:
        parse(f"{HEADER},estimate_s\na,0,100,1,1000,0.5,P1,x,-5\n")
    assert info.value.column == "estimate_s" and info.value.line == 2
    (s,) = scale_trace([a], time_scale=10.0)
    assert (s.duration_s, s.estimate_s) == (10.0, 3.0)


def test_estimates_round_trip(tmp_path):
    tasks = [TraceTask("a", 0.0, 100.0, 1, 1.0, 1.0, Priority.P0, "x", estimate_s=33.5),
             TraceTask("b", 0.0, 100.0, 1, 1.0, 1.0, Priority.P0, "x")]
    path = tmp_path / "trace.csv"
    write_trace(tasks, path)
    assert read_trace(path) == tasks
    assert "estimate_s" not in trace_to_text(tasks[1:]).splitlines()[0]


def test_misestimate_scales_and_scatters_estimates_deterministically():
    tasks = [TraceTask(f"t{i}", 0.0, 1000.0, 1, 1.0, 1.0, Priority.P2, "x") for i in range(2000)]
    tasks[0] = TraceTask("own", 0.0, 1000.0, 1, 1.0, 1.0, Priority.P2, "x", estimate_s=5.0)
    short = misestimate(tasks, scale=0.5)
    assert short[0].estimate_s == 5.0  # a client's own estimate stays
    assert {t.estimate_s for t in short[1:]} == {500.0}
    noisy = misestimate(tasks, noise=1.0, seed=7)
    assert noisy == misestimate(tasks, noise=1.0, seed=7) != misestimate(tasks, noise=1.0, seed=8)
    logs = [math.log(t.estimate_s / t.duration_s) for t in noisy[1:]]
    mean = sum(logs) / len(logs)
    std = (sum((x - mean) ** 2 for x in logs) / len(logs)) ** 0.5
    assert abs(mean) < 0.1 and 0.9 < std < 1.1  # log-normal around the truth, sigma 1
    assert all(t.duration_s == 1000.0 for t in noisy)  # what runs does not change
    assert misestimate(tasks) == tasks
    with pytest.raises(ValueError, match="scale"):
        misestimate(tasks, scale=-1.0)


# ---- openb pod lists ----------------------------------------------------------------------

OPENB_HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time"
OPENB_ROWS = [
    # LS whole GPU, still running at the trace end (deletion = the file's max)
    "openb-pod-0000,12000,16384,1,1000,,LS,Running,100,5000,100",
    # LS shared GPU, waited 7 s to be scheduled in the real cluster
    "openb-pod-0001,6000,12288,1,460,,LS,Succeeded,110,400,117",
    # CPU only: skipped
    "openb-pod-0002,8000,8192,0,0,,LS,Running,120,300,120",
    # pending: never scheduled, skipped
    "openb-pod-0003,8000,8192,1,1000,,BE,Pending,130,200,",
    # BE 8-GPU job that failed after 1000 s: kept with its run time
    "openb-pod-0004,96000,393216,8,1000,,BE,Failed,140,1150,150",
    "openb-pod-0005,4000,8192,1,250,T4,Guaranteed,Running,150,900,160",
    "openb-pod-0006,4000,8192,2,1000,,Burstable,Succeeded,160,860,160",
]


def _rows(lines):
    import csv

    return list(csv.DictReader(io.StringIO("\n".join([OPENB_HEADER, *lines]) + "\n")))


def test_openb_mapping_on_literal_rows():
    tasks, stats = convert_openb_rows(_rows(OPENB_ROWS), source="pods.csv")
    by = {t.task_id: t for t in tasks}
    assert set(by) == {"openb-pod-0000", "openb-pod-0001", "openb-pod-0004", "openb-pod-0005", "openb-pod-0006"}
    assert (stats.rows, stats.written, stats.skipped_cpu_only, stats.skipped_pending, stats.censored) == (7, 5, 1, 1, 1)
    ref = OPENB_VRAM_FRACTION * OPENB_REFERENCE_VRAM_MIB
    a = by["openb-pod-0000"]
    assert (a.submit_s, a.duration_s, a.priority, a.kind, a.gpu_share, a.vram_mib) == (
        0.0, 4900.0, Priority.P0, "inference", 1.0, round(ref, 1)
    )
    b = by["openb-pod-0001"]
    # submitted at creation (relative to the first creation), runs deletion - scheduled
    assert (b.submit_s, b.duration_s, b.gpu_share) == (10.0, 283.0, 0.46)
    assert b.vram_mib == round(0.46 * ref, 1)
    c = by["openb-pod-0004"]
    assert (c.num_gpus, c.gpu_share, c.priority, c.kind, c.duration_s) == (8, 1.0, Priority.P3, "background", 1000.0)
    d = by["openb-pod-0005"]
    assert (d.priority, d.kind, d.gpu_spec, d.gpu_share) == (Priority.P1, "training", "T4", 0.25)
    e = by["openb-pod-0006"]
    assert (e.priority, e.kind, e.num_gpus, e.gpu_share) == (Priority.P2, "batch", 2, 1.0)
    assert stats.by_priority == {"P0": 2, "P1": 1, "P2": 1, "P3": 1}
    # written sorted by submission
    assert [t.submit_s for t in tasks] == sorted(t.submit_s for t in tasks)


def test_openb_time_scale_and_bad_values():
    tasks, _ = convert_openb_rows(_rows(OPENB_ROWS[:2]), time_scale=10.0)
    assert [(t.submit_s, t.duration_s) for t in tasks] == [(0.0, 490.0), (1.0, 28.3)]
    bad = OPENB_ROWS[1].replace(",460,", ",abc,")
    with pytest.raises(TraceFormatError) as info:
        convert_openb_rows(_rows([OPENB_ROWS[0], bad]), source="pods.csv")
    assert (info.value.line, info.value.column) == (3, "gpu_milli")


def test_openb_list_without_times_takes_them_from_the_reference():
    reference = _rows(OPENB_ROWS)
    import csv

    bare = list(csv.DictReader(io.StringIO(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"
        "openb-pod-0001,6000,12288,1,460\n"
        "openb-pod-9000,96000,393216,8,1000\n"
    )))
    with pytest.raises(TraceFormatError, match="no time columns"):
        convert_openb_rows(bare)
    tasks, stats = convert_openb_rows(bare, reference=reference, seed=1)
    by = {t.task_id: t for t in tasks}
    assert by["openb-pod-0001"].duration_s == 283.0  # the reference row's own times
    # the new 8-GPU row borrows the times of the only scheduled 8-GPU reference row
    assert by["openb-pod-9000"].duration_s == 1000.0 and by["openb-pod-9000"].num_gpus == 8
    assert stats.synthesized_times == 1


def test_convert_openb_file(tmp_path):
    pods = tmp_path / "openb_pod_list_default.csv"
    pods.write_text("\n".join([OPENB_HEADER, *OPENB_ROWS]) + "\n")
    out = tmp_path / "trace.csv"
    tasks, stats = convert_openb(pods, out)
    assert read_trace(out) == tasks and stats.written == 5


# ---- clusters -----------------------------------------------------------------------------------


def test_known_models_and_lookup():
    assert lookup_model("rtx-4090") is KNOWN_MODELS["RTX 4090"]
    assert lookup_model("NVIDIA A100-SXM4-80GB") is KNOWN_MODELS["A100 80GB"]
    assert lookup_model("v100m16").memory_mib == 16_160.0
    assert lookup_model("nope") is None
    # what NVML calls an H200 (read on one, driver 580.159)
    assert lookup_model("NVIDIA H200") is KNOWN_MODELS["H200"] and KNOWN_MODELS["H200"].memory_mib == 143_771
    for key in ("RTX 4090", "A100 80GB", "H100", "H200", "V100M16", "V100M32", "T4", "P100", "A10", "G1", "G2", "G3", "K20c", "M40"):
        m = KNOWN_MODELS[key]
        assert m.memory_mib > 0 and m.speed > 0
    assert KNOWN_MODELS["RTX 4090"].speed == 1.0


def test_cluster_file_round_trip_and_facts(tmp_path):
    text = (
        "node_id,gpus,model,vram_mib_per_gpu,speed\n"
        "a,4,RTX 4090,,\n"
        "b,8,V100M32,,\n"
        "c,2,MyCard,12000,0.7\n"
    )
    nodes = parse_cluster(io.StringIO(text))
    assert nodes[0] == ClusterNode("a", 4, "NVIDIA GeForce RTX 4090", 24_564.0, 1.0, "RTX 4090")
    assert (nodes[1].model, nodes[1].vram_mib_per_gpu) == ("Tesla V100-SXM2-32GB", 32_768.0)
    assert (nodes[2].model, nodes[2].vram_mib_per_gpu, nodes[2].speed) == ("MyCard", 12000.0, 0.7)
    path = tmp_path / "c.csv"
    write_cluster(nodes, path)
    assert read_cluster(path) == nodes
    snap = ClusterSnapshot.build(node_facts(nodes))
    assert snap.gpu_count == 14
    # gpu_spec constraints match the full model names
    mask = gpu_spec_mask(snap.gpu_model, snap.memory_total_mib, "V100M16|V100M32")
    assert mask.sum() == 8


@pytest.mark.parametrize(
    ("row", "column", "fragment"),
    [
        ("a,0,T4", "gpus", "1..64"),
        ("a,x,T4", "gpus", "1..64"),
        ("a,2,Mystery", "model", "unknown model 'Mystery'"),
        ("a,2,T4,-5,", "vram_mib_per_gpu", "> 0"),
        ("a,2,T4,,fast", "speed", "expected a number"),
        (",2,T4", "node_id", "non-empty"),
    ],
)
def test_cluster_reader_errors(row, column, fragment):
    header = "node_id,gpus,model" + (",vram_mib_per_gpu,speed" if row.count(",") == 4 else "")
    with pytest.raises(TraceFormatError) as info:
        parse_cluster(io.StringIO(f"{header}\n{row}\n"), source="c.csv")
    assert info.value.line == 2 and info.value.column == column
    assert fragment in str(info.value)


def test_cluster_duplicate_node():
    with pytest.raises(TraceFormatError, match="duplicate node_id"):
        parse_cluster(io.StringIO("node_id,gpus,model\na,1,T4\na,1,T4\n"))


def test_homogeneous():
    nodes = homogeneous(8, 4, "RTX 4090")
    assert len(nodes) == 8 and all(n.gpus == 4 and n.speed == 1.0 for n in nodes)
    assert nodes[0].node_id == "node-00" and nodes[7].node_id == "node-07"
    assert all(n.nvlink_pairs == () for n in nodes)
    with pytest.raises(ValueError, match="unknown model"):
        homogeneous(1, 1, "Voodoo2")
    linked = homogeneous(2, 4, "H100", nvlink="all")
    assert linked[1].nvlink_pairs == ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3))


@pytest.mark.parametrize(
    ("text", "gpus", "pairs"),
    [
        ("", 8, ()),
        ("None", 8, ()),
        ("pairs", 4, ((0, 1), (2, 3))),
        ("pairs", 3, ((0, 1),)),
        ("all", 3, ((0, 1), (0, 2), (1, 2))),
        (" 2-3; 1-0;3-2 ", 4, ((0, 1), (2, 3))),
    ],
)
def test_nvlink_column_values(text, gpus, pairs):
    assert nvlink_pairs(text, gpus) == pairs


def test_cluster_nvlink_column_round_trip_and_errors(tmp_path):
    text = ("node_id,gpus,model,nvlink\n"
            "dgx,8,H100,all\n"
            "bridged,4,RTX 4090,pairs\n"
            "mesh,4,V100M32,0-1;1-2;2-3;3-0\n"
            "plain,2,T4,\n")
    nodes = parse_cluster(io.StringIO(text))
    assert len(nodes[0].nvlink_pairs) == 28 and nodes[1].nvlink_pairs == ((0, 1), (2, 3))
    assert nodes[2].nvlink_pairs == ((0, 1), (0, 3), (1, 2), (2, 3)) and nodes[3].nvlink_pairs == ()
    path = tmp_path / "c.csv"
    write_cluster(nodes, path)
    assert read_cluster(path) == nodes
    assert path.read_text().splitlines()[1:3] == ["dgx,8,H100,81559,2.2,all", "bridged,4,RTX 4090,24564,1,pairs"]
    snap = ClusterSnapshot.build(node_facts(nodes))
    assert snap.node_nvlink[1] == frozenset({frozenset({0, 1}), frozenset({2, 3})})
    # a cluster without NVLink is written as before, without the column
    buf = io.StringIO()
    write_cluster(nodes[3:], buf)
    assert buf.getvalue().splitlines()[0] == "node_id,gpus,model,vram_mib_per_gpu,speed"
    for row, fragment in (("a,4,T4,0-4", "below 4"), ("a,4,T4,1-1", "two different"), ("a,4,T4,ring", "like 0-1;2-3")):
        with pytest.raises(TraceFormatError) as info:
            parse_cluster(io.StringIO(f"node_id,gpus,model,nvlink\n{row}\n"), source="c.csv")
        assert (info.value.line, info.value.column) == (2, "nvlink") and fragment in str(info.value)


def test_openb_node_list_normalises_speed(tmp_path):
    src = tmp_path / "nodes.csv"
    src.write_text(
        "sn,cpu_milli,memory_mib,gpu,model\n"
        "n0,64000,262144,2,P100\n"
        "n1,96000,393216,8,G2\n"
        "n2,8000,32768,0,T4\n"
    )
    nodes = convert_openb_nodes(src, tmp_path / "out.csv")
    assert [n.node_id for n in nodes] == ["n0", "n1"]  # GPU-less node skipped
    mean = sum(n.gpus * n.speed for n in nodes) / sum(n.gpus for n in nodes)
    assert math.isclose(mean, 1.0, rel_tol=1e-3)
    ratio = nodes[1].speed / nodes[0].speed
    assert math.isclose(ratio, KNOWN_MODELS["G2"].speed / KNOWN_MODELS["P100"].speed, rel_tol=1e-3)
    raw = convert_openb_nodes(src, normalize_speed=False)
    assert raw[0].speed == KNOWN_MODELS["P100"].speed
    assert read_cluster(tmp_path / "out.csv") == nodes
