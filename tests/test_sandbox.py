"""The agent unit's seccomp filter without systemd (coordinator/sandbox.py):
the unit's lines resolved as systemd resolves them, the BPF program's
answers worked out instruction by instruction, and the filter in force on a
real child process, which real_gpu.py --agent-seccomp puts the NVML agent
under on a GPU host."""

from __future__ import annotations

import errno
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from waiting import wait_until

from coordinator.sandbox import UNISTD_64, SandboxError, UnitSeccomp, from_unit, launcher_argv, syscall_numbers

ROOT = Path(__file__).resolve().parent.parent
AGENT_UNIT = ROOT / "systemd" / "gpulb-agent.service"
HAVE_SYSTEMD = shutil.which("systemd-analyze") is not None and UNISTD_64.exists()
needs_systemd = pytest.mark.skipif(not HAVE_SYSTEMD, reason="systemd-analyze and the kernel headers resolve the unit")

AUDIT_ARCH_X86_64, AUDIT_ARCH_I386 = 0xC000003E, 0x40000003


def run_bpf(program: list[tuple[int, int, int, int]], nr: int, arch: int = AUDIT_ARCH_X86_64, args=(0,) * 6) -> int:
    """Classic BPF as the kernel runs a seccomp filter, for the instructions
    a filter uses (32-bit absolute loads, jumps on a constant, returns): the
    action word it returns for one system call."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, *args)
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = program[pc]
        if code == 0x20:  # LD W ABS
            acc = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif code == 0x15:  # JEQ K
            pc += 1 + (jt if acc == k else jf)
        elif code == 0x35:  # JGE K
            pc += 1 + (jt if acc >= k else jf)
        elif code == 0x06:  # RET K
            return k
        else:
            raise AssertionError(f"instruction {code:#x} at {pc} not expected in a filter")


ALLOW, ERRNO = 0x7FFF0000, 0x00050000


def toy_spec() -> UnitSeccomp:
    return UnitSeccomp(syscalls={"read": 0, "write": 1, "socket": 41, "ioctl": 16}, errno=errno.EPERM, families=[1, 2, 10])


def test_the_program_allows_the_listed_calls_and_refuses_the_rest_with_the_units_errno() -> None:
    prog = toy_spec().program()
    assert [run_bpf(prog, nr) for nr in (0, 1, 16)] == [ALLOW] * 3
    assert run_bpf(prog, 101) == ERRNO | errno.EPERM  # ptrace: not listed
    assert run_bpf(prog, 0, arch=AUDIT_ARCH_I386) == ERRNO | errno.EPERM  # SystemCallArchitectures=native
    assert run_bpf(prog, 0x40000000 | 0) == ERRNO | errno.EPERM  # x32 ABI, another ABI on the same arch
    as_eio = UnitSeccomp(syscalls={"read": 0}, errno=errno.EIO).program()
    assert run_bpf(as_eio, 1) == ERRNO | errno.EIO


def test_the_program_allows_socket_only_for_the_units_address_families() -> None:
    prog = toy_spec().program()
    for family in (1, 2, 10):  # AF_UNIX, AF_INET, AF_INET6
        assert run_bpf(prog, 41, args=(family, 1, 0, 0, 0, 0)) == ALLOW
    for family in (16, 17, 0):  # AF_NETLINK, AF_PACKET, AF_UNSPEC
        assert run_bpf(prog, 41, args=(family, 1, 0, 0, 0, 0)) == ERRNO | errno.EAFNOSUPPORT
    # the calls after the socket block are still told apart by number
    assert run_bpf(prog, 16) == ALLOW and run_bpf(prog, 17) == ERRNO | errno.EPERM
    anyfamily = UnitSeccomp(syscalls={"socket": 41}, families=[]).program()
    assert run_bpf(anyfamily, 41, args=(16, 0, 0, 0, 0, 0)) == ALLOW


def test_log_only_lets_through_and_logs_what_the_filter_would_refuse() -> None:
    """The diagnostic form: one run names every call a program would miss
    under the unit (the kernel logs SECCOMP_RET_LOG), where EPERM stops it at
    the first."""
    prog = toy_spec().program(log_only=True)
    log = 0x7FFC0000
    assert run_bpf(prog, 101) == log and run_bpf(prog, 0, arch=AUDIT_ARCH_I386) == log
    assert run_bpf(prog, 41, args=(16, 0, 0, 0, 0, 0)) == log
    assert run_bpf(prog, 0) == ALLOW and run_bpf(prog, 41, args=(2, 0, 0, 0, 0, 0)) == ALLOW


def test_the_spec_round_trips_through_json_and_refuses_another_arch() -> None:
    spec = toy_spec()
    back = UnitSeccomp.from_json(spec.to_json())
    assert back.program() == spec.program() and back.families == [1, 2, 10]
    raw = json.loads(spec.to_json())
    raw["arch"] = "aarch64"
    with pytest.raises(SandboxError, match="arch: only x86_64"):
        UnitSeccomp.from_json(json.dumps(raw))


@needs_systemd
def test_the_agent_units_filter_resolves_as_systemd_expands_it() -> None:
    spec = from_unit(AGENT_UNIT)
    numbers = syscall_numbers()
    # what the agent lives on: NVML's ioctls on /dev/nvidia*, files, sockets, threads, exec
    for name in ("ioctl", "openat", "mmap", "mprotect", "read", "futex", "clone3", "execve", "socket", "connect",
                 "epoll_wait", "getrandom", "prctl"):
        assert spec.syscalls.get(name) == numbers[name], name
    # what @system-service leaves out: debugging, modules, mounts, reboot, clock, raw I/O, swap
    for name in ("ptrace", "init_module", "finit_module", "mount", "reboot", "kexec_load", "settimeofday",
                 "iopl", "swapon", "bpf", "perf_event_open"):
        assert name not in spec.syscalls, name
    assert spec.errno == errno.EPERM and spec.families == [1, 2, 10]
    assert "systemd" in spec.source and "gpulb-agent.service" in spec.source
    assert 200 < len(spec.syscalls) < len(numbers)


@needs_systemd
@pytest.mark.parametrize(
    "service, message",
    [
        ("ExecStart=/bin/true\nSystemCallFilter=~@mount\n", "deny-lists"),
        ("ExecStart=/bin/true\n", "no SystemCallFilter="),
        ("SystemCallFilter=@system-service\nRestrictAddressFamilies=AF_BLUETOOTH\n", "RestrictAddressFamilies= AF_BLUETOOTH"),
        ("SystemCallFilter=@system-service\nSystemCallErrorNumber=ENOPE\n", "SystemCallErrorNumber=ENOPE"),
    ],
)
def test_units_the_module_cannot_resolve_are_refused_naming_the_setting(tmp_path: Path, service: str, message: str) -> None:
    unit = tmp_path / "x.service"
    unit.write_text("[Service]\n" + service)
    with pytest.raises(SandboxError, match=message):
        from_unit(unit)


@needs_systemd
def test_filter_lines_accumulate_as_systemd_merges_them(tmp_path: Path) -> None:
    # two lines accumulate, as systemd merges them; a plain name joins the groups
    two = tmp_path / "two.service"
    two.write_text("[Service]\nSystemCallFilter=@basic-io\nSystemCallFilter=ioctl\nSystemCallErrorNumber=EACCES\n")
    spec = from_unit(two)
    assert {"read", "write", "ioctl", "execve"} <= set(spec.syscalls) and "socket" not in spec.syscalls
    assert spec.errno == errno.EACCES
    # an empty assignment resets the list, as in systemd
    reset = tmp_path / "reset.service"
    reset.write_text("[Service]\nSystemCallFilter=@network-io\nSystemCallFilter=\nSystemCallFilter=@basic-io\n")
    assert "socket" not in from_unit(reset).syscalls and "read" in from_unit(reset).syscalls


_PROBE = textwrap.dedent(
    """
    import ctypes, errno, json, socket
    libc = ctypes.CDLL(None, use_errno=True)
    out = {"mode": open("/proc/self/status").read().split("Seccomp:")[1].split()[0]}
    out["ptrace"] = errno.errorcode.get(ctypes.get_errno()) if libc.ptrace(0, 0, 0, 0) != 0 else "ok"  # PTRACE_TRACEME
    try:
        socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0).close(); out["netlink"] = "ok"
    except OSError as exc:
        out["netlink"] = errno.errorcode[exc.errno]
    socket.socket(socket.AF_INET, socket.SOCK_STREAM).close(); out["inet"] = "ok"
    print(json.dumps(out))
    """
)


@needs_systemd
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the filter is built for x86_64")
def test_a_child_under_the_units_filter_is_refused_what_the_unit_refuses() -> None:
    probe = [sys.executable, "-c", _PROBE]
    plain = json.loads(subprocess.run(probe, capture_output=True, text=True, check=True).stdout)
    confined = subprocess.run(launcher_argv(probe, seccomp=from_unit(AGENT_UNIT)), capture_output=True, text=True)
    assert confined.returncode == 0, confined.stderr
    got = json.loads(confined.stdout)
    assert plain == {"mode": "0", "ptrace": "ok", "netlink": "ok", "inet": "ok"}
    assert got == {"mode": "2", "ptrace": "EPERM", "netlink": "EAFNOSUPPORT", "inet": "ok"}


@needs_systemd
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the filter is built for x86_64")
def test_the_agents_check_passes_under_the_units_filter_and_says_so() -> None:
    argv = [sys.executable, "-m", "agent.main", "--check", "--backend", "sim", "--sim-gpus", "2", "--check-rounds", "2",
            "--no-coordinator", "--json"]
    confined = subprocess.run(launcher_argv(argv, seccomp=from_unit(AGENT_UNIT)), capture_output=True, text=True,
                              timeout=60, cwd=ROOT)
    assert confined.returncode == 0, confined.stdout[-2000:] + confined.stderr[-2000:]
    report = json.loads(confined.stdout)
    assert report["ok"] is True and report["seccomp_filter"] is True and len(report["gpus"]) == 2


def test_the_module_writes_the_spec_for_a_gpu_host(tmp_path: Path) -> None:
    out = tmp_path / "agent-seccomp.json"
    run = subprocess.run([sys.executable, "-m", "coordinator.sandbox", "--out", str(out)], capture_output=True, text=True,
                         cwd=ROOT)
    if not HAVE_SYSTEMD:
        assert run.returncode == 2 and "error:" in run.stderr
        return
    assert run.returncode == 0, run.stderr
    spec = UnitSeccomp.from_json(out.read_text())
    assert spec.syscalls == from_unit(AGENT_UNIT).syscalls
    assert f"{len(spec.syscalls)} system calls allowed, the rest EPERM" in run.stdout


COORDINATOR_UNIT = ROOT / "systemd" / "gpulb-coordinator.service"


@needs_systemd
@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the filter is built for x86_64")
def test_the_daemons_serve_under_their_units_filters(tmp_path: Path) -> None:
    """Both services as real processes, each under its own unit's filter
    (and W^X where the kernel enforces it): telemetry in, a task placed and
    kept in SQLite across a restart, metrics, a reload, a clean stop.
    What systemd would refuse them, they do not need."""
    import os
    import signal
    import urllib.request

    import grpc
    from prometheus_client.parser import text_string_to_metric_families

    from coordinator.demo import ProcessGroup, can_deny_write_execute, free_port
    from protos import cluster_pb2 as cpb
    from protos import cluster_pb2_grpc as cpb_grpc
    from protos import tasks_pb2 as tpb
    from protos import tasks_pb2_grpc as tpb_grpc

    wx = can_deny_write_execute()
    coord_filter, agent_filter = from_unit(COORDINATOR_UNIT), from_unit(AGENT_UNIT)
    port, mport = free_port(), free_port()
    target = f"127.0.0.1:{port}"
    coord_argv = [sys.executable, "-m", "coordinator.main", "--listen", target, "--metrics-listen", f"127.0.0.1:{mport}",
                  "--state-dir", str(tmp_path / "state"), "--insecure", "--log-format", "json"]
    group = ProcessGroup(tmp_path)
    try:
        coord = group.start("coordinator", coord_argv, write_xor_execute=wx, seccomp=coord_filter)
        agent = group.start("agent", [sys.executable, "-m", "agent.main", "--backend", "sim", "--sim-gpus", "2",
                                      "--coordinator", target, "--node-id", "confined", "--log-format", "json"],
                            write_xor_execute=wx, seccomp=agent_filter)
        for proc in (coord, agent):  # the launcher confines itself, then execs the daemon
            wait_until(lambda: "\nSeccomp:\t2\n" in open(f"/proc/{proc.pid}/status").read(), "the filter in force")
        with grpc.insecure_channel(target) as ch:
            ops, sched = cpb_grpc.ClusterOperatorStub(ch), tpb_grpc.SchedulerStub(ch)
            wait_until(lambda: len(ops.ListGpus(cpb.ListGpusRequest(), timeout=2).gpus) == 2, "the agent's GPUs")
            sched.ScheduleTask(tpb.ScheduleTaskRequest(spec=tpb.TaskSpec(
                task_id="confined-1", vram_mib=1024, gpu_share=0.2, priority=tpb.PRIORITY_P1, kind="inference",
                duration_s=3600), wait=False), timeout=5)
            leased = wait_until(lambda: (t := sched.GetTask(tpb.GetTaskRequest(task_id="confined-1"), timeout=2)).state
                           == tpb.TASK_STATE_LEASED and t, "the task's lease")
            assert leased.assignment.node_id == "confined"
        text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
        names = {f.name for f in text_string_to_metric_families(text)}
        assert "gpulb_gpu_utilization_ratio" in names
        os.kill(coord.pid, signal.SIGHUP)  # reload: re-reads its configuration, keeps serving
        with grpc.insecure_channel(target) as ch:
            wait_until(lambda: len(cpb_grpc.ClusterOperatorStub(ch).ListGpus(cpb.ListGpusRequest(), timeout=2).gpus) == 2,
                  "serving after the reload")
        codes = dict(group.stop_all())
        assert codes == {"coordinator": 0, "agent": 0}, (tmp_path / "coordinator.log").read_text()[-2000:]
        # the lease was written to SQLite under the filter: a restarted coordinator has it
        group = ProcessGroup(tmp_path / "again")
        (tmp_path / "again").mkdir()
        group.start("coordinator", coord_argv, write_xor_execute=wx, seccomp=coord_filter)
        with grpc.insecure_channel(target) as ch:
            again = wait_until(lambda: tpb_grpc.SchedulerStub(ch).GetTask(tpb.GetTaskRequest(task_id="confined-1"), timeout=2),
                          "the restarted coordinator")
        assert again.state == tpb.TASK_STATE_LEASED and again.assignment.node_id == "confined"
    finally:
        group.stop_all()
    for log in tmp_path.glob("**/*.log"):
        assert "Operation not permitted" not in log.read_text(), log


def test_the_launcher_is_left_out_when_nothing_is_asked_and_refuses_an_orphan() -> None:
    argv = [sys.executable, "-c", "print('ran')"]
    assert launcher_argv(argv) == argv
    ran = subprocess.run(launcher_argv(argv, die_with_parent_pid=os.getpid()), capture_output=True, text=True)
    assert (ran.returncode, ran.stdout) == (0, "ran\n")
    # started by another parent than the one it is to die with: it would run on unwatched
    orphan = subprocess.run(launcher_argv(argv, die_with_parent_pid=1), capture_output=True, text=True)
    assert orphan.returncode != 0 and "the parent is gone" in orphan.stderr and orphan.stdout == ""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the filter is built for x86_64")
@pytest.mark.timeout(120)
def test_confined_children_start_while_this_process_is_busy_with_grpc() -> None:
    """Confinement set up by a preexec_fn (Python in the forked child) died
    now and then here: gRPC's fork handler restarts its poller in the child
    and closing the inherited descriptors pulls its epoll descriptor away
    (SIGABRT, 2 to 6 in 150). The launcher runs nothing between fork and
    exec."""
    import threading
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()

    def hammer() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while not stop.is_set():
                stub.Check(health_pb2.HealthCheckRequest(), timeout=5)

    threads = [threading.Thread(target=hammer, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    spec = from_unit(AGENT_UNIT) if HAVE_SYSTEMD else None  # the hazard was running Python before exec, any filter
    try:
        codes = [subprocess.run(launcher_argv([sys.executable, "-c", "pass"], die_with_parent_pid=os.getpid(),
                                              seccomp=spec), capture_output=True).returncode for _ in range(100)]
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
        server.stop(0)
    assert codes == [0] * 100, sorted(set(codes))


def _gone_or_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in fh)
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(60)
def test_a_child_of_a_process_group_dies_with_its_parent_even_by_sigkill(tmp_path: Path) -> None:
    """What the demo promises: not even a SIGKILLed demo leaves its cluster
    running (the launcher's PR_SET_PDEATHSIG, kept across exec)."""
    import signal
    import time

    up = tmp_path / "up"
    parent_script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from coordinator.demo import ProcessGroup
        child = ProcessGroup(Path({str(tmp_path)!r})).start(
            "child", [sys.executable, "-c", "import sys, time; open(sys.argv[1], 'w').write('up'); time.sleep(60)", {str(up)!r}])
        print(child.pid, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    child_pid = int(parent.stdout.readline())
    deadline = time.monotonic() + 30
    while not up.exists():  # the launcher has exec'd the child, which is running
        assert time.monotonic() < deadline and parent.poll() is None, "the child never started"
        time.sleep(0.05)
    assert not _gone_or_zombie(child_pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    while not _gone_or_zombie(child_pid):
        assert time.monotonic() < deadline + 10, "the child outlived its SIGKILLed parent"
        time.sleep(0.05)
