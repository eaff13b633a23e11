"""``gpulb-agent --check``: what this host's agent would report, before it is
enabled as a service.

It opens the backend the service would open (NVML, or the simulator where
asked), reads every GPU for a few rounds at the fastest sampling period, and
prints: each GPU as gpulb will know it (and whether the scheduler's model
table knows the model, since an unknown one starts with a neutral speed
prior), the last reading field by field (a field the GPU does not report is
said to be missing, not shown as 0), how long a round and each NVML read took
against the fastest period, and the health of every GPU; then it asks the
coordinator's gRPC health the way the agent will connect (TLS, client
certificate, token; ``--no-coordinator`` leaves that out). Exit status: 0
when every GPU read OK, a round fits the fastest period and the coordinator
serves, 1 otherwise, 2 when the backend cannot start. A check whose backend
``auto`` fell back to simulated GPUs because NVML could not be used is 1:
it read no real GPU, so it cannot say a GPU host is ready.

Readings are shown as the agent sends them: one outside its field's range (a
failed sensor's 255 %) is "not reported" with the reason, as
``agent.telemetry.drop_out_of_range`` makes it. A GPU in MIG mode, or one
that does not report its utilisation, is a WARNING line, not a failure: the
agent reads and reports it (memory, power, temperature, health)
and the node registers; what MIG changes is what the scheduler can do with
the GPU (gpulb schedules whole GPUs, and scores a GPU without utilisation as
fully busy), which is the operator's call, not a broken host.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from agent.backend import GpuBackend, GpuInfo, GpuSample, driver_version_of
from agent.nvml import MIG_WARNING  # the agent logs the same words at start
from agent.telemetry import drop_out_of_range
from coordinator.tables import render_table
from protos import telemetry_pb2 as pb
from scheduler.cluster import lookup_model

__all__ = [
    "CheckReport", "GpuCheck", "run_check", "render_check", "run_and_render", "check_coordinator", "SAMPLE_FIELDS",
    "write_xor_execute_in_force",
    "seccomp_filter_in_force",
]

#: GpuSample fields shown, in order, with their display unit
SAMPLE_FIELDS: tuple[tuple[str, str], ...] = (
    ("util_gpu_pct", "%"),
    ("util_memory_pct", "%"),
    ("memory_used_mib", "MiB"),
    ("memory_total_mib", "MiB"),
    ("temperature_c", "°C"),
    ("power_mw", "mW"),
    ("power_limit_mw", "mW"),
    ("sm_clock_mhz", "MHz"),
    ("pcie_rx_kbps", "KB/s"),
    ("pcie_tx_kbps", "KB/s"),
    ("ecc_corrected", ""),
    ("ecc_uncorrected", ""),
    ("process_count", ""),
    ("xid_last", ""),  # last Xid event; not reported: the GPU cannot deliver them
)

#: a round may use at most this share of the fastest period: the rest is the
#: agent's encoding and sending, and slack for a slow read
ROUND_BUDGET_SHARE = 0.5


@dataclass
class GpuCheck:
    index: int
    uuid: str
    model: str
    memory_total_mib: int
    memory_reserved_mib: int | None  # held by the driver, counted as used
    pci_bus_id: str
    known_model: str  # the scheduler's key for the model, "" when unknown
    speed_prior: float | None  # relative to an RTX 4090, None when unknown
    health: str
    values: dict[str, int | None]
    errors: dict[str, str]
    processes: list[tuple[int, int]]  # (pid, MiB)
    read_ms: dict[str, float] = field(default_factory=dict)  # mean over rounds
    mig_enabled: bool | None = None  # None: not known (no MIG on this GPU, or not NVML)


@dataclass
class CheckReport:
    backend: str
    parallel: bool
    rounds: int
    interval_min_s: float
    round_ms: list[float]
    gpus: list[GpuCheck]
    topology: list[dict[str, Any]]
    driver_version: str = ""  # the NVIDIA driver and its CUDA version; "" off NVML
    # how this check ran, against how the unit runs the agent (User=gpulb,
    # MemoryDenyWriteExecute=yes): a check as root can pass where the service fails
    process_user: str = ""
    write_xor_execute: bool | None = None  # None: not known on this platform
    seccomp_filter: bool | None = None  # a seccomp filter confines it (SystemCallFilter=); None: not Linux
    # why NVML could not be used when --backend auto fell back to simulated
    # GPUs; "" when NVML ran or the simulator was asked for by name. Such a
    # check read no real GPU, so it fails: a pre-flight on a GPU host must not
    # pass on simulated ones
    nvml_error: str = ""

    @property
    def round_ms_max(self) -> float:
        return max(self.round_ms) if self.round_ms else math.nan

    @property
    def round_ms_median(self) -> float:
        return statistics.median(self.round_ms) if self.round_ms else math.nan

    @property
    def round_fits(self) -> bool:
        return self.round_ms_median <= ROUND_BUDGET_SHARE * self.interval_min_s * 1000

    @property
    def healthy(self) -> bool:
        return bool(self.gpus) and all(g.health == "OK" for g in self.gpus)

    @property
    def simulated_instead_of_nvml(self) -> bool:
        return bool(self.nvml_error)

    @property
    def ok(self) -> bool:
        return self.healthy and self.round_fits and not self.simulated_instead_of_nvml

    @property
    def warnings(self) -> list[str]:
        """What does not fail the check but limits what gpulb does with a
        GPU: MIG mode, no utilisation reading."""
        out = []
        for g in self.gpus:
            if g.mig_enabled:
                out.append(f"GPU {g.index}: {MIG_WARNING.replace('INDEX', str(g.index))}")
            elif g.health in ("OK", "FROZEN") and g.values.get("util_gpu_pct") is None:
                out.append(
                    f"GPU {g.index}: util_gpu_pct is not reported"
                    + (f" ({g.errors['util_gpu_pct']})" if "util_gpu_pct" in g.errors else "")
                    + ": the scheduler scores this GPU as fully busy"
                )
        return out

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(
            round_ms_median=self.round_ms_median,
            round_ms_max=self.round_ms_max,
            round_fits=self.round_fits,
            healthy=self.healthy,
            simulated_instead_of_nvml=self.simulated_instead_of_nvml,
            warnings=self.warnings,
            ok=self.ok,
        )
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def _health_name(health: int) -> str:
    return pb.GpuHealth.Name(health).removeprefix("GPU_HEALTH_")


def _gpu_check(info: GpuInfo, sample: GpuSample, read_ms: dict[str, float], mig_enabled: bool | None = None) -> GpuCheck:
    known = lookup_model(info.model)
    return GpuCheck(
        index=info.index,
        uuid=info.uuid,
        model=info.model,
        memory_total_mib=info.memory_total_mib,
        memory_reserved_mib=info.memory_reserved_mib,
        pci_bus_id=info.pci_bus_id,
        known_model=known.key if known else "",
        speed_prior=known.speed if known else None,
        health=_health_name(sample.health),
        values={name: getattr(sample, name) for name, _ in SAMPLE_FIELDS},
        errors=dict(sample.errors),
        processes=[(p.pid, p.used_memory_mib) for p in (sample.processes or ())],
        read_ms=read_ms,
        mig_enabled=mig_enabled,
    )


def run_check(
    backend: GpuBackend,
    *,
    rounds: int = 10,
    interval_min_s: float = 0.2,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.perf_counter,
    nvml_error: str = "",
) -> CheckReport:
    """Read ``backend`` ``rounds`` times, ``interval_min_s`` apart (start to
    start), and report the last reading of each GPU and the rounds' timing.
    ``nvml_error``: NVML's error when ``backend`` is the simulator that
    ``--backend auto`` fell back to (the report then fails)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    inventory = {info.index: info for info in backend.inventory()}
    read_seconds = getattr(backend, "read_seconds", None)
    round_ms: list[float] = []
    read_sums: dict[int, dict[str, float]] = {}
    read_counts: dict[int, dict[str, int]] = {}
    samples: list[GpuSample] = []
    for n in range(rounds):
        started = clock()
        samples = backend.sample()
        took = clock() - started
        drop_out_of_range(samples, logged=None)  # as the agent sends them
        round_ms.append(took * 1000)
        if read_seconds is not None:
            for index, reads in read_seconds().items():
                sums = read_sums.setdefault(index, {})
                counts = read_counts.setdefault(index, {})
                for name, seconds in reads.items():
                    sums[name] = sums.get(name, 0.0) + seconds * 1000
                    counts[name] = counts.get(name, 0) + 1
        if n + 1 < rounds:
            sleep(max(0.0, interval_min_s - took))
    mig_modes = getattr(backend, "mig_modes", None)
    mig = mig_modes() if mig_modes is not None else {}
    gpus = []
    for sample in samples:
        info = inventory.get(sample.index) or GpuInfo(index=sample.index, uuid="", model="unknown", memory_total_mib=0)
        sums, counts = read_sums.get(sample.index, {}), read_counts.get(sample.index, {})
        gpus.append(_gpu_check(info, sample, {name: sums[name] / counts[name] for name in sums}, mig.get(sample.index)))
    return CheckReport(
        backend=backend.name,
        parallel=bool(getattr(backend, "parallel", False)),
        rounds=rounds,
        interval_min_s=interval_min_s,
        round_ms=round_ms,
        gpus=gpus,
        driver_version=driver_version_of(backend),
        process_user=_process_user(),
        write_xor_execute=write_xor_execute_in_force(),
        seccomp_filter=seccomp_filter_in_force(),
        nvml_error=nvml_error,
        topology=[
            {"gpu_a": link.gpu_a, "gpu_b": link.gpu_b, "kind": pb.LinkKind.Name(link.kind).removeprefix("LINK_KIND_").lower(), "nvlink_count": link.nvlink_count}
            for link in backend.topology()
        ],
    )


#: how systemd/gpulb-agent.service runs the agent; a check that runs otherwise says so
UNIT_USER = "gpulb"
UNIT_CHECK_COMMAND = (
    "systemd-run --pipe --wait -p User=gpulb -p SupplementaryGroups=video -p MemoryDenyWriteExecute=yes "
    "-p SystemCallFilter=@system-service -p SystemCallErrorNumber=EPERM "
    "/usr/local/bin/gpulb-agent --config /etc/gpulb/agent.toml --check"
)


def _process_user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError, AttributeError):
        return ""


def write_xor_execute_in_force() -> bool | None:
    """Whether this process may not map writable+executable memory (as under
    the unit's MemoryDenyWriteExecute=yes): a probe mapping, closed at once."""
    import mmap

    try:
        mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC).close()
        return False
    except PermissionError:
        return True
    except (OSError, AttributeError, ValueError):
        return None  # no such protection flags here


def seccomp_filter_in_force(status: str = "/proc/self/status") -> bool | None:
    """Whether a seccomp filter confines this process (as the unit's
    ``SystemCallFilter=`` does): the kernel's ``Seccomp:`` mode, 2 for a
    filter. None where there is no such field (not Linux)."""
    try:
        with open(status) as fh:
            for line in fh:
                if line.startswith("Seccomp:"):
                    return line.split()[1] == "2"
    except OSError:
        pass
    return None


_FIELD_NAMES = {name for name, _ in SAMPLE_FIELDS}


def _why(g: GpuCheck) -> str:
    """The errors of a GPU that are not one field's (its handle, a call
    that timed out), as " (...)"; "" if none."""
    said = [f"{key}: {text}" for key, text in g.errors.items() if key not in _FIELD_NAMES]
    return f" ({'; '.join(said)})" if said else ""


def _value(value: int | None, unit: str, error: str | None) -> str:
    if value is None:
        return f"error: {error}" if error else "not reported"
    return f"{value} {unit}".rstrip()


def render_check(report: CheckReport) -> str:
    """The report as tables a person reads at a terminal."""
    out: list[str] = []
    fallback = " (auto: NVML unusable, so SIMULATED GPUs)" if report.simulated_instead_of_nvml else ""
    out.append(
        f"backend {report.backend}{fallback}: {len(report.gpus)} GPU(s), {report.rounds} rounds "
        f"{report.interval_min_s * 1000:.0f} ms apart{', GPUs read in parallel' if report.parallel else ''}"
        + (f"; NVIDIA driver {report.driver_version}" if report.driver_version else "")
    )
    out.append("")
    out.append(
        render_table(
            ["GPU", "MODEL", "UUID", "MEMORY MiB", "RESERVED MiB", "PCI", "SCHEDULER MODEL", "SPEED PRIOR", "HEALTH"],
            [
                [
                    g.index,
                    g.model,
                    g.uuid,
                    g.memory_total_mib,
                    g.memory_reserved_mib if g.memory_reserved_mib is not None else "-",
                    g.pci_bus_id or "-",
                    g.known_model or "unknown: neutral prior, learned from completions",
                    f"{g.speed_prior:g}" if g.speed_prior is not None else "1 (default)",
                    g.health,
                ]
                for g in report.gpus
            ],
        )
    )
    out.append("")
    out.append("last reading")
    out.append(
        render_table(
            ["FIELD", *[f"GPU {g.index}" for g in report.gpus]],
            [
                [name, *[_value(g.values.get(name), unit, g.errors.get(name)) for g in report.gpus]]
                for name, unit in SAMPLE_FIELDS
            ],
        )
    )
    reserved = [g for g in report.gpus if g.memory_reserved_mib]
    if reserved:
        out.append(
            "memory_used_mib counts the driver's reservation (RESERVED MiB above), which nvidia-smi leaves out "
            "of its 'used': no task can allocate it, so gpulb counts it as used"
        )
    procs = [(g.index, pid, mib) for g in report.gpus for pid, mib in g.processes]
    if procs:
        out.append("")
        out.append(render_table(["GPU", "PID", "USED MiB"], [list(p) for p in procs]))
    reads = sorted({name for g in report.gpus for name in g.read_ms})
    if reads:
        out.append("")
        out.append("NVML read time, ms (mean over the rounds)")
        out.append(
            render_table(
                ["READ", *[f"GPU {g.index}" for g in report.gpus]],
                [[name, *[f"{g.read_ms[name]:.2f}" if name in g.read_ms else "-" for g in report.gpus]] for name in reads],
            )
        )
    if report.topology:
        out.append("")
        out.append(
            render_table(
                ["GPU A", "GPU B", "LINK", "NVLINKS"],
                [[t["gpu_a"], t["gpu_b"], t["kind"], t["nvlink_count"]] for t in report.topology],
            )
        )
    budget = ROUND_BUDGET_SHARE * report.interval_min_s * 1000
    out.append("")
    out.append(
        f"round: median {report.round_ms_median:.1f} ms, max {report.round_ms_max:.1f} ms "
        f"(budget {budget:.0f} ms, {ROUND_BUDGET_SHARE:.0%} of the fastest period): "
        + ("fits" if report.round_fits else "TOO SLOW: raise --interval-min or check the driver")
    )
    bad = [g for g in report.gpus if g.health != "OK"]
    out.append(
        "health: every GPU OK" if not bad else "health: " + ", ".join(f"GPU {g.index} {g.health}{_why(g)}" for g in bad)
    )
    for warning in report.warnings:
        out.append(f"WARNING: {warning}")
    if report.process_user:
        wx = {True: "W^X enforced", False: "W^X not enforced", None: "W^X unknown"}[report.write_xor_execute]
        line = f"process: user {report.process_user}, {wx}"
        if report.seccomp_filter is not None:
            line += ", seccomp filter" if report.seccomp_filter else ", no seccomp filter"
        if report.process_user != UNIT_USER or report.write_xor_execute is False or report.seccomp_filter is False:
            # informational: it does not fail the check, the device reads above are real
            line += (f" (the unit runs the agent as {UNIT_USER} under W^X and a seccomp filter; to check it that way: "
                     f"{UNIT_CHECK_COMMAND})")
        out.append(line)
    if report.simulated_instead_of_nvml:
        out.append(
            f"backend: FAIL: these GPUs are SIMULATED: --backend auto fell back to the simulator because NVML could "
            f"not be used ({report.nvml_error}); no real GPU of this host was read, so it is not ready. Fix the driver "
            "or libnvidia-ml.so.1 and check again with --backend nvml (as the installed agent.toml sets), or ask for "
            "--backend sim to check the simulator"
        )
    out.append("check: " + ("PASS" if report.ok else "FAIL"))
    return "\n".join(out)


def check_coordinator(
    target: str, *, ca_file: str = "", cert_file: str = "", key_file: str = "", token: str = "", timeout_s: float = 3.0
) -> tuple[bool, str]:
    """Whether the coordinator at ``target`` answers the agent's way (the
    same TLS, client certificate and token), by the standard gRPC health
    check of its AgentGateway service: (ok, what happened)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if ca_file or cert_file:
        from coordinator.security import SecurityConfigError, channel_credentials

        try:
            creds = channel_credentials(ca_file or None, cert_file or None, key_file or None, token or None)
        except (OSError, SecurityConfigError) as exc:
            return False, f"TLS files unusable: {exc}"
        channel = grpc.secure_channel(target, creds)
    else:
        channel = grpc.insecure_channel(target)
    try:
        service = "gpulb.v1.AgentGateway"
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{target}: {service} {status}"
    except grpc.RpcError as exc:
        return False, f"{target}: {exc.code().name}: {exc.details()}"
    finally:
        channel.close()


def run_and_render(
    backend: GpuBackend,
    *,
    rounds: int,
    interval_min_s: float,
    as_json: bool,
    coordinator: tuple[bool, str] | None = None,
    print_fn: Callable[[str], None] = print,
    nvml_error: str = "",
) -> int:
    """Check ``backend`` and print the report; ``coordinator`` is the
    outcome of ``check_coordinator`` (None: not checked); ``nvml_error`` as
    for ``run_check``. Exit status."""
    report = run_check(backend, rounds=rounds, interval_min_s=interval_min_s, nvml_error=nvml_error)
    ok = report.ok and (coordinator is None or coordinator[0])
    if as_json:
        data = report.to_dict()
        if coordinator is not None:
            data["coordinator"] = {"ok": coordinator[0], "detail": coordinator[1]}
            data["ok"] = ok
        print_fn(json.dumps(data, indent=2, sort_keys=True))
    else:
        text = render_check(report)
        if coordinator is not None:
            head, _, _ = text.rpartition("\ncheck: ")
            verdict = "reachable" if coordinator[0] else "NOT READY"
            text = f"{head}\ncoordinator: {verdict}: {coordinator[1]}\ncheck: {'PASS' if ok else 'FAIL'}"
        print_fn(text)
    return 0 if ok else 1
