"""The shipped service files, example configuration and install script:
``systemd-analyze verify`` clean, the sandbox the units promise, examples that
the daemons' own loaders accept and that cannot drift from the code, and the
Python stack running with W^X memory enforced (``MemoryDenyWriteExecute=``)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.settings import env_names, load_settings, render_settings
from scheduler.config import SchedulerConfig

ROOT = Path(__file__).resolve().parent.parent
SYSTEMD = ROOT / "systemd"
UNITS = ("gpulb-coordinator.service", "gpulb-agent.service")
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Section -> key -> every value assigned (systemd allows repeats)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"assignment outside a section: {raw!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=VALUE: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def service(name: str) -> dict[str, list[str]]:
    return parse_unit((SYSTEMD / name).read_text())["Service"]


# ---- systemd-analyze verify -------------------------------------------------------------------


def _verifiable_copy(name: str, tmp_path: Path) -> Path:
    """The unit with ExecStart's binary swapped for one that exists here.

    /usr/local/bin/gpulb-* exist only once installed, and verify reports a
    missing executable; the rest of the line (the --config argument) is kept.
    """
    text = (SYSTEMD / name).read_text()
    entry = name.removesuffix(".service")
    real = Path(sys.executable).parent / entry
    binary = str(real) if real.exists() else "/bin/true"
    patched, count = re.subn(rf"^ExecStart=/usr/local/bin/{entry}\b", f"ExecStart={binary}", text, flags=re.M)
    assert count == 1, f"{name}: expected one ExecStart=/usr/local/bin/{entry}"
    copy = tmp_path / name
    copy.write_text(patched)
    return copy


def _verify(path: Path) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    return subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", str(path)], capture_output=True, text=True, timeout=60
    )


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("name", UNITS)
def test_systemd_analyze_verify_is_clean(name: str, tmp_path: Path) -> None:
    result = _verify(_verifiable_copy(name, tmp_path))
    # verify exits 0 on unknown keys and bad values too; only silence is clean.
    assert result.returncode == 0 and result.stderr == "" and result.stdout == "", result.stderr + result.stdout


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed")
def test_verify_would_catch_a_typo(tmp_path: Path) -> None:
    copy = _verifiable_copy("gpulb-coordinator.service", tmp_path)
    copy.write_text(copy.read_text().replace("ProtectSystem=strict", "ProtectSystm=strict").replace("WatchdogSec=30s", "WatchdogSec=thirty"))
    err = _verify(copy).stderr
    assert "Unknown key" in err and "ProtectSystm" in err
    assert "thirty" in err


# ---- what the units promise ----------------------------------------------------------------------


COMMON = {
    "Type": "notify",
    "NotifyAccess": "main",
    "WatchdogSec": "30s",
    "Restart": "on-failure",
    "RestartSec": "2s",
    "User": "gpulb",
    "Group": "gpulb",
    "StateDirectory": "gpulb",
    "ConfigurationDirectory": "gpulb",
    "TimeoutStopSec": "15s",
    "KillSignal": "SIGTERM",
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectControlGroups": "yes",
    "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
    "RestrictNamespaces": "yes",
    "LockPersonality": "yes",
    "SystemCallArchitectures": "native",
    "CapabilityBoundingSet": "",
}


@pytest.mark.parametrize("name", UNITS)
def test_units_are_notify_services_sandboxed_as_an_unprivileged_user(name: str) -> None:
    svc = service(name)
    got = {key: svc.get(key, [None])[-1] for key in COMMON}
    assert got == COMMON
    assert "DynamicUser" not in svc  # trade-off documented in the unit's comments


def test_coordinator_unit() -> None:
    svc = service("gpulb-coordinator.service")
    assert svc["ExecStart"] == ["/usr/local/bin/gpulb-coordinator --config /etc/gpulb/coordinator.toml"]
    assert svc["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert svc["EnvironmentFile"] == ["-/etc/gpulb/coordinator.env"]
    assert svc["PrivateDevices"] == ["yes"]
    assert svc["MemoryDenyWriteExecute"] == ["yes"]
    # The state directory systemd creates is the one the coordinator uses.
    assert "GPULB_STATE_DIR=%S/gpulb" in svc["Environment"]
    assert "GPULB_STATE_DIR" in env_names()


def test_coordinator_unit_allows_the_descriptors_its_connections_need() -> None:
    """systemd's default soft limit (1,024) was used up by 1,000 idle
    connections and new gRPC clients then waited up to 14 s (QA pass 23):
    the unit leaves room for 10,000 agent streams besides every watch stream
    and metrics connection the defaults allow, each on its own connection."""
    soft = service("gpulb-coordinator.service")["LimitNOFILE"][-1].split(":")[0]
    defaults = CoordinatorConfig()
    needed = 10_000 + defaults.max_watch_streams + defaults.metrics_max_connections + 1_000  # SQLite, the loop's own, clients
    assert soft != "infinity" and int(soft) >= needed


def test_agent_unit_reaches_nvidia_devices_and_nothing_else() -> None:
    svc = service("gpulb-agent.service")
    assert svc["ExecStart"] == ["/usr/local/bin/gpulb-agent --config /etc/gpulb/agent.toml $GPULB_AGENT_ARGS"]
    assert svc["EnvironmentFile"] == ["-/etc/gpulb/agent.env"]
    assert "ExecReload" not in svc  # the agent has nothing to reload
    assert svc["PrivateDevices"] == ["no"] and svc["DevicePolicy"] == ["closed"]
    assert sorted(svc["DeviceAllow"]) == sorted(["char-nvidia-frontend rw", "/dev/nvidiactl rw", "char-nvidia-caps r"])
    assert svc["SupplementaryGroups"] == ["video"]
    # checked with libnvidia-ml on a real GPU (see the unit); the Python side below
    assert svc["MemoryDenyWriteExecute"] == ["yes"]
    assert "ProcSubset" not in svc  # would hide /proc/diskstats and /proc/driver/nvidia


@pytest.mark.parametrize("name", UNITS)
def test_units_run_the_installed_entry_points(name: str) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    binary = Path(shlex.split(service(name)["ExecStart"][0])[0]).name
    assert binary in scripts


# ---- example configuration ----------------------------------------------------------------------


def test_coordinator_example_is_generated_from_the_code() -> None:
    expected = render_settings(load_settings(None, {}, {}), commented_defaults=True)
    assert (SYSTEMD / "coordinator.toml").read_text() == expected, (
        "systemd/coordinator.toml is stale: python -m coordinator.settings > systemd/coordinator.toml"
    )


def test_coordinator_example_loads_as_the_defaults() -> None:
    s = load_settings(SYSTEMD / "coordinator.toml", {}, {})
    assert s.coordinator == CoordinatorConfig() and s.scheduler == SchedulerConfig()


def _env_lines(path: Path) -> dict[str, str]:
    """VAR=value lines of an EnvironmentFile, commented-out examples included."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^#?([A-Z][A-Z0-9_]*)=(.*)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip().strip('"')
    return out


def test_coordinator_env_example_names_real_settings_with_valid_values() -> None:
    examples = _env_lines(SYSTEMD / "coordinator.env")
    assert examples and set(examples) <= set(env_names())
    s = load_settings(None, examples, {})
    assert {s.sources[env_names()[k].key] for k in examples} == {f"env:{k}" for k in examples}
    assert s.warnings == ()


def test_agent_example_is_accepted_by_the_agents_own_loader() -> None:
    from agent.main import _settings, parse_args

    defaults = _settings(parse_args([]))
    loaded = _settings(parse_args(["--config", str(SYSTEMD / "agent.toml")]))
    assert loaded["backend"] == "nvml"  # a service reports real GPUs or fails
    for key, value in defaults.items():
        if key != "backend":
            assert loaded[key] == value, key
    text = (SYSTEMD / "agent.toml").read_text()
    for key in defaults:  # every option is documented, set or commented out
        assert re.search(rf"^(# )?{key} = ", text, re.M) or f"[agent.{key}]" in text, key


def test_agent_env_example_holds_flags_the_agent_accepts() -> None:
    from agent.main import parse_args

    examples = _env_lines(SYSTEMD / "agent.env")
    assert set(examples) == {"GPULB_AGENT_ARGS"}
    args = parse_args(["--config", "/etc/gpulb/agent.toml", *shlex.split(examples["GPULB_AGENT_ARGS"])])
    assert args.node_id == "gpu-host-01" and dict(args.label) == {"rack": "r1", "zone": "a"}


# ---- install script -------------------------------------------------------------------------------


INSTALL = SYSTEMD / "install.sh"


def _install(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(INSTALL), *args], capture_output=True, text=True, timeout=60)


def test_install_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(INSTALL)], capture_output=True, timeout=30).returncode == 0
    assert os.access(INSTALL, os.X_OK)


# every shell script an operator or CI runs: the installer, scripts/* and .ci/run
SHELL_SCRIPTS = [INSTALL, *sorted((ROOT / "scripts").iterdir()), ROOT / ".ci" / "run"]


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_scripts_pass_shellcheck(script: Path) -> None:
    # -x follows the scripts' `source` of scripts/_venv.sh, from the repository root
    result = subprocess.run(["shellcheck", "-x", str(script.relative_to(ROOT))], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stdout


def test_install_dry_run_prints_every_step_and_changes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    result = _install("--dry-run", "--root", str(root), "--source", "/src/gpulb")
    assert result.returncode == 0, result.stderr
    steps = [line[2:] for line in result.stdout.splitlines() if line.startswith("+ ")]
    # --root stages files only: a venv built under the staging root would name
    # it in every shebang (tests/test_install.py); the target builds /opt/gpulb
    assert not any("-m venv" in s or "pip install" in s or "set-search" in s for s in steps)
    assert "/opt/gpulb/bin/python -m pip install --upgrade /src/gpulb" in result.stdout  # printed for the target
    for exe in ("gpulb", "gpulb-coordinator", "gpulb-agent"):
        # links point at the real /opt path, not the staging root
        assert f"ln -sfn /opt/gpulb/bin/{exe} {root}/usr/local/bin/{exe}" in steps
    for f in ("coordinator.toml", "agent.toml"):
        assert f"install -m 0644 {SYSTEMD}/{f} {root}/etc/gpulb/{f}" in steps
    for f in ("coordinator.env", "agent.env"):
        assert f"install -m 0640 {SYSTEMD}/{f} {root}/etc/gpulb/{f}" in steps
    for unit in UNITS:
        assert f"install -m 0644 {SYSTEMD}/{unit} {root}/etc/systemd/system/{unit}" in steps
    assert not any("useradd" in s or "systemctl" in s for s in steps)  # --root: the target host's job
    assert list(root.iterdir()) == []


def test_install_keeps_an_operators_configuration(tmp_path: Path) -> None:
    etc = tmp_path / "etc" / "gpulb"
    etc.mkdir(parents=True)
    (etc / "coordinator.toml").write_text("[coordinator]\n")
    result = _install("--dry-run", "--root", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert f"# keeping {etc}/coordinator.toml" in result.stdout
    assert f"{etc}/coordinator.toml" not in "".join(l for l in result.stdout.splitlines() if l.startswith("+ "))
    assert f"install -m 0644 {SYSTEMD}/agent.toml {etc}/agent.toml" in result.stdout


def test_install_on_the_host_creates_the_user_and_reloads_systemd() -> None:
    result = _install("--dry-run")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "+ groupadd --system gpulb" in out or "# group gpulb exists" in out
    assert "+ useradd --system --gid gpulb" in out or "# user gpulb exists" in out
    assert "--shell /usr/sbin/nologin" in out or "# user gpulb exists" in out
    assert "+ install -m 0640 -g gpulb" in out or "# keeping /etc/gpulb/coordinator.env" in out
    assert "+ systemctl daemon-reload" in out


def test_install_refuses_unknown_arguments() -> None:
    result = _install("--dryrun")
    assert result.returncode == 2 and "unknown argument: --dryrun" in result.stderr


# ---- MemoryDenyWriteExecute: the Python stack under W^X ----------------------------------------------


_MDWE_CHECK = textwrap.dedent(
    """
    import ctypes, errno, mmap, sys

    # prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN): the kernel's form of the
    # seccomp filter systemd installs for MemoryDenyWriteExecute=yes (Linux >= 6.3).
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(65, 1, 0, 0, 0) != 0:
        print("PR_SET_MDWE unsupported:", errno.errorcode.get(ctypes.get_errno()))
        sys.exit(77)
    try:
        mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    except OSError:
        pass
    else:
        sys.exit("a writable+executable mapping was allowed: W^X is not in force")

    import asyncio

    async def main():
        # Everything the daemons load after start: grpc's C core, numpy,
        # snappy, prometheus-client, structlog, pynvml's ctypes bindings.
        import grpc
        import agent.nvml  # noqa: F401
        from agent.client import Agent, AgentConfig
        from agent.sim import SimBackend
        from coordinator.config import CoordinatorConfig
        from coordinator.server import Coordinator
        from protos import cluster_pb2 as cpb, cluster_pb2_grpc as cpb_grpc

        coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0"))
        port = await coord.start()
        agent = Agent(
            AgentConfig(node_id="mdwe", coordinator=f"127.0.0.1:{port}", interval_min_s=0.05, interval_max_s=0.1),
            SimBackend(gpus=2, seed=3),
        )
        task = asyncio.create_task(agent.run())
        try:
            for _ in range(200):
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                    reply = await cpb_grpc.ClusterOperatorStub(ch).ListGpus(cpb.ListGpusRequest())
                if len(reply.gpus) == 2:
                    break
                await asyncio.sleep(0.05)
            assert len(reply.gpus) == 2, reply
            # registered GPUs show in ListGpus before their first reading is
            # applied: scrape until the readings are there
            for _ in range(100):
                reader, writer = await asyncio.open_connection("127.0.0.1", coord.metrics_port)
                writer.write(b"GET /metrics HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
                body = await reader.read()
                writer.close()
                if b"gpulb_gpu_utilization_ratio{" in body:
                    break
                await asyncio.sleep(0.05)
            assert b"gpulb_gpu_utilization_ratio{" in body, body[:200]
            # numba's JIT needs W+X memory: without an ahead-of-time build
            # the coordinator serves on the numpy set search and says why;
            # with one ($GPULB_AOT_DIR) it runs compiled all the same
            from scheduler import setsearch
            print("SET_SEARCH", setsearch.ready(), setsearch.mode, setsearch.failure)
        finally:
            await agent.stop()
            await task
            await coord.stop(grace_s=0.1)

    asyncio.run(main())
    print("MDWE_OK")
    """
)


def _run_mdwe(tmp_path: Path, aot_dir: str) -> subprocess.CompletedProcess:
    script = tmp_path / "mdwe_check.py"
    script.write_text(_MDWE_CHECK)
    env = dict(os.environ, GPULB_AOT_DIR=aot_dir)
    result = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=90, env=env)
    if result.returncode == 77:
        pytest.skip(f"kernel lacks PR_SET_MDWE (Linux < 6.3): {result.stdout.strip()}")
    assert result.returncode == 0 and "MDWE_OK" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.timeout(120)
def test_daemons_run_with_write_xor_execute_memory(tmp_path: Path) -> None:
    result = _run_mdwe(tmp_path, str(tmp_path / "no-aot-build-here"))
    if importlib.util.find_spec("numba") is not None:
        assert "SET_SEARCH False None PermissionError" in result.stdout, result.stdout[-3000:]
        assert "set_search_not_compiled" in result.stdout + result.stderr


@pytest.mark.timeout(180)
def test_the_ahead_of_time_set_search_runs_under_write_xor_execute(tmp_path: Path, aot_build: Path) -> None:
    """What systemd/install.sh builds: loaded without numba's JIT, so the
    hardened coordinator keeps the compiled set search."""
    result = _run_mdwe(tmp_path, str(aot_build))
    assert "SET_SEARCH True aot None" in result.stdout, result.stdout[-3000:]
    assert "set_search_compiled" in result.stdout + result.stderr
