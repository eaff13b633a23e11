"""``gpulb-agent``: the per-host daemon. Picks a GPU backend, then streams its
readings to the coordinator until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import structlog

from agent.backend import EXIT_REREAD, BackendUnavailable, GpuBackend, driver_version_of
from agent.client import Agent, AgentConfig
from coordinator.sdnotify import Notifier, WatchdogPinger
from coordinator.view import _NODE_ID as NODE_ID  # the rule the coordinator registers node ids by
from coordinator.view import RegistrationError, validate_register  # and labels by
from protos import telemetry_pb2 as pb
from protos.runtime import LOG_LEVELS, configure_logging

__all__ = ["main", "build_backend", "open_backend", "parse_args", "build_parser", "EXIT_USAGE", "EXIT_REFUSED"]

log = structlog.get_logger("gpulb.agent")

#: bad flags or configuration (argparse's own code), a backend, token file or TLS file that cannot be used
EXIT_USAGE = 2
#: the coordinator refused the registration for good (sysexits' EX_CONFIG): retrying cannot help
EXIT_REFUSED = 78
# EXIT_REREAD (75, agent.backend): the GPUs read wrong (refused as
# register.gpus / topology several times, or NVML lists others after a
# re-init): a new process reads them again (sysexits' EX_TEMPFAIL; systemd
# restarts it)

_EPILOG = (
    "exit status: 0 stopped (SIGTERM, SIGINT; SIGHUP is logged and changes nothing); 2 a bad flag or --config option "
    "(a --coordinator that is not HOST:PORT, a node id or label the coordinator would refuse), or the backend, the token file or "
    "the TLS files cannot be used (unreadable, a key that is not the certificate's, a certificate expired or not yet "
    "valid); 78 the coordinator refused the registration with INVALID_ARGUMENT, UNAUTHENTICATED or "
    "PERMISSION_DENIED (a wrong token or certificate; a node id or label it would refuse exits 2 at start): the log line registration_refused "
    "says what to fix, and retrying would not help (systemd: RestartPreventExitStatus=78); 75 the GPUs read wrong "
    "through NVML (a GPU that fell off the bus or a driver not up yet: refused as register.gpus) 5 times in a row, "
    "so a new process (systemd restarts it) reads them again. A node id or GPU held "
    "by another live agent (ALREADY_EXISTS) is logged as an error and retried with the backoff growing to 30 s. "
    "--check exits 0/1/2 as said above."
)

#: numeric options: (type, lowest, highest); None = unbounded
_NUMBERS: dict[str, tuple[type, float | None, float | None]] = {
    "sim_gpus": (int, 1, 64),  # the coordinator takes 1..64 GPUs per node
    "sim_seed": (int, None, None),
    "interval_min": (float, 0.01, 60.0),
    "interval_max": (float, 0.01, 60.0),
    "outage_buffer": (int, 1, 1_000_000),
    "check_rounds": (int, 1, None),  # a flag only, not a --config option
}
_CHOICES = {
    "backend": ("nvml", "sim", "auto"),
    "sim_workload": ("synthetic", "idle", "replay"),
    "log_level": LOG_LEVELS,
    "log_format": ("auto", "json", "console"),
}

#: NODE_ID in words, as the coordinator's refusal (coordinator.view.validate_register) says it
NODE_ID_RULE = "1-128 of [A-Za-z0-9._-], starting alphanumeric"


def _range_text(kind: type, low, high) -> str:
    noun = "an integer" if kind is int else "a number"
    if low is None and high is None:
        return noun
    if high is None:
        return f"{noun} >= {low:g}" if kind is float else f"{noun} >= {low}"
    return f"{noun} in {low:g}..{high:g}" if kind is float else f"{noun} in {low}..{high}"


def _check_number(key: str, value: Any) -> Any:
    """``value`` as the option's type, or ValueError saying the range."""
    kind, low, high = _NUMBERS[key]
    wanted = _range_text(kind, low, high)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ValueError(f"must be {wanted}, got {value!r}")
    if kind is float:
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"must be {wanted}, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"must be {wanted}, got {value!r}")
    return value


def _number_flag(key: str):
    """An argparse type for a numeric option: errors name the flag and the range."""
    kind = _NUMBERS[key][0]

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {_range_text(*_NUMBERS[key])}, got {text!r}") from None
        try:
            return _check_number(key, value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _fail(message: str) -> None:
    """An argparse-style error: one line on stderr, exit 2."""
    _fail_all([message])


def _fail_all(messages: list[str]) -> None:
    """Every problem found, one argparse-style line each, then exit 2: an
    agent.toml or command line with several mistakes is fixed in one pass,
    not one restart per mistake."""
    for message in messages:
        print(f"gpulb-agent: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


#: what a flag's error line ends with
_HELP_POINTER = " (gpulb-agent --help lists the flags)"


class _Refused:
    """A flag's value that did not convert or is not one of its choices (the
    problem is in ``flag_problems``): not taken, as if the flag were not given."""

    def __repr__(self) -> str:
        return "<refused>"


_REFUSED = _Refused()


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (argparse prints its whole usage,
    a dozen lines, before it) and a pointer to --help; exit status 2.

    A flag's value that does not convert or is not one of its choices, and a
    flag it does not know, do not stop the parse: ``parse_args`` returns with
    every such problem in the namespace's ``flag_problems`` ((dest, line)
    pairs; dest "" for an unknown flag), for ``_settings`` to report with the
    --config file's. Only what argparse cannot parse past (a flag without its
    value) ends the parse at once, with the problems found before it."""

    #: while parse_args runs: the problems found so far (None: argparse's own way, stop at the first)
    _problems: list[tuple[str, str]] | None = None

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        self._problems = []
        try:
            namespace, extras = self.parse_known_args(args, namespace)
            if extras:
                self._problems.append(("", f"unrecognized arguments: {' '.join(extras)}{_HELP_POINTER}"))
            namespace.flag_problems = self._problems
        finally:
            self._problems = None
        return namespace

    def _get_value(self, action, arg_string):
        try:
            return super()._get_value(action, arg_string)
        except argparse.ArgumentError as exc:
            if self._problems is None:
                raise
            self._problems.append((action.dest, f"{exc}{_HELP_POINTER}"))
            return _REFUSED

    def _check_value(self, action, value):
        if value is _REFUSED:
            return
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as exc:
            if self._problems is None:
                raise
            self._problems.append((action.dest, f"{exc}{_HELP_POINTER}"))

    def error(self, message: str):
        found = self._problems or []
        _fail_all([line for _, line in found] + [f"{message}{_HELP_POINTER}"])


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--label takes KEY=VALUE, got {text!r}")
    return key, value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gpulb-agent", description="Stream this host's GPU telemetry to a gpulb coordinator.",
                                epilog=_EPILOG)
    p.add_argument("--config", type=Path, help="TOML file; flags override it")
    p.add_argument("--coordinator", help="HOST:PORT of the coordinator, port 1..65535, an IPv6 address in brackets "
                                         "([::1]:50051) (default 127.0.0.1:50051)")
    p.add_argument("--node-id", help=f"this node's cluster-unique name, {NODE_ID_RULE} (default: the hostname)")
    p.add_argument("--backend", choices=("nvml", "sim", "auto"),
                   help="GPU backend (default auto: NVML, else simulated GPUs, which --check fails)")
    p.add_argument("--sim-gpus", type=_number_flag("sim_gpus"), help="simulated GPUs, 1..64 (sim backend, default 4)")
    p.add_argument("--sim-seed", type=_number_flag("sim_seed"),
                   help="seed of the simulated GPUs' readings (default: from the node id); their UUIDs derive from node id, seed and index")
    p.add_argument("--sim-workload", choices=("synthetic", "idle", "replay"), help="simulated load (default synthetic)")
    p.add_argument("--label", action="append", type=_label, default=[], help="node label KEY=VALUE (repeatable); checked at start by the coordinator's rule: "
                   "keys 1-63 of [A-Za-z0-9._/-] starting alphanumeric, values at most 256 characters, at most 64 labels")
    p.add_argument("--interval-min", type=_number_flag("interval_min"), help="fastest sampling period, s, 0.01..60 (default 0.2)")
    p.add_argument("--interval-max", type=_number_flag("interval_max"),
                   help="slowest sampling period, s, 0.01..60, at least --interval-min (default 2.0)")
    p.add_argument("--ca-file", help="PEM CA that signed the coordinator's certificate (turns TLS on)")
    p.add_argument("--cert-file", help="PEM client certificate for mutual TLS (CN or SAN = the node id)")
    p.add_argument("--key-file", help="PEM private key of --cert-file")
    p.add_argument("--token-file", help="file holding a bearer token with the agent role")
    p.add_argument("--outage-buffer", type=_number_flag("outage_buffer"),
                   help="sampling rounds kept while the coordinator is away, 1..1000000 (default 300)")
    p.add_argument(
        "--check", action="store_true",
        help="read this host's GPUs a few times and print what the agent would report (and how long a round takes), "
        "and ask the coordinator's health the agent's way (TLS, certificate, token), then exit: "
        "0 all GPUs OK, a round fits the fastest period and the coordinator serves; 1 not (also when --backend auto "
        "found no NVML and read simulated GPUs); 2 the backend cannot start",
    )
    p.add_argument("--check-rounds", type=_number_flag("check_rounds"), default=10,
                   help="rounds --check reads, at least 1 (default 10)")
    p.add_argument("--no-coordinator", action="store_true", help="--check leaves out the coordinator's health check")
    p.add_argument("--json", action="store_true", help="--check prints its report as JSON (the field ok is the verdict)")
    p.add_argument("--log-level", choices=LOG_LEVELS, help=f"{', '.join(LOG_LEVELS)} (default info)")
    p.add_argument("--log-format", choices=("auto", "json", "console"),
                   help="json, console, or auto: console on a terminal, else JSON (default auto)")
    return p


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """Defaults, then the config file, then the flags; exit 2 naming every
    problem found (one line each: the file's options, the flags, then what
    the merged values break), not only the first."""
    settings: dict[str, Any] = {
        "coordinator": "127.0.0.1:50051",
        "node_id": socket.gethostname(),
        "backend": "auto",
        "sim_gpus": 4,
        "sim_seed": None,
        "sim_workload": "synthetic",
        "labels": {},
        "interval_min": 0.2,
        "interval_max": 2.0,
        "log_level": "info",
        "log_format": "auto",
        "ca_file": "",
        "cert_file": "",
        "key_file": "",
        "token_file": "",
        "outage_buffer": 300,
    }
    where = {key: "default" for key in settings}
    problems: list[str] = []
    #: options whose value was refused (in the file or as a flag) and not set right by a flag:
    #: the checks of the merged values leave them out rather than judge a value not meant
    refused: set[str] = set()
    #: the file could not be read, is not TOML, or its [agent] is not a table: its values are unknown
    file_unknown = False
    if args.config is not None:
        data: dict[str, Any] | None = None
        try:
            with args.config.open("rb") as fh:
                data = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            problems.append(f"--config {args.config}: {exc}")
            file_unknown = True
        section = data.get("agent", data) if data is not None else {}
        if data is not None and "agent" in data:
            # beside [agent], a key or table is a slip (a key above the header, [agnet]): it was dropped unsaid
            for key in data:
                if key != "agent":
                    kind = "table" if isinstance(data[key], dict) else "option"
                    problems.append(f"{args.config}: {kind} {key!r} outside [agent] (every option goes under [agent])")
        if not isinstance(section, dict):
            problems.append(f"{args.config}: [agent] must be a table")
            file_unknown, section = True, {}
        for key, value in section.items():
            if key not in settings:
                problems.append(f"{args.config}: unknown option {key!r} (known: {', '.join(sorted(settings))})")
                continue
            try:
                settings[key] = _checked_option(key, value, args.config)
            except ValueError as exc:
                problems.append(str(exc))
                refused.add(key)
                continue
            where[key] = f"{key} in {args.config}"
    flag_problems = getattr(args, "flag_problems", [])
    problems += [line for _, line in flag_problems]
    refused_flags = {dest for dest, _ in flag_problems}
    for key in ("coordinator", "node_id", "backend", "sim_gpus", "sim_seed", "sim_workload", "interval_min", "interval_max",
                "log_level", "log_format", "ca_file", "cert_file", "key_file", "token_file", "outage_buffer"):
        if key in refused_flags:
            refused.add(key)
            continue
        value = getattr(args, key)
        if value is not None:
            settings[key] = value
            where[key] = "--" + key.replace("_", "-")
            refused.discard(key)  # the flag wins over the file's refused value
    flag_labels = dict(label for label in args.label if label is not _REFUSED)
    settings["labels"] = {**settings["labels"], **flag_labels}

    def known(key: str) -> bool:
        """Whether ``key``'s value is the one meant: not refused, nor a default the unread file may set."""
        return key not in refused and not (file_unknown and where[key] == "default")

    if known("coordinator"):
        problems += _coordinator_problems(settings["coordinator"], where["coordinator"], args.config)
    if known("node_id"):
        problems += _node_id_problems(settings["node_id"], where["node_id"], args.config)
    problems += _label_problems(settings["labels"], flag_labels, args.config)
    if known("interval_min") and known("interval_max") and settings["interval_min"] > settings["interval_max"]:
        def said(key: str) -> str:
            value = f"{settings[key]:g} s"
            return f"the default {key} {value}" if where[key] == "default" else f"{where[key]} ({value})"

        problems.append(f"{said('interval_min')} is above {said('interval_max')}: "
                        "the fastest sampling period cannot exceed the slowest")
    if problems:
        _fail_all(problems)
    return settings


def _node_id_problems(node_id: str, where: str, path: Path | None) -> list[str]:
    """A node id the coordinator refuses at registration, said (exit 2 at
    start: found there, it was exit 78 after connecting, and a failed
    systemd unit); [] when it takes it."""
    if NODE_ID.match(node_id):
        return []
    if where == "default":
        return [f"the hostname {node_id!r} (node_id's default) is not a node id the coordinator accepts: it must be "
                f"{NODE_ID_RULE}; give one with --node-id or node_id in --config"]
    said = "argument --node-id:" if where.startswith("--") else f"{path}: option 'node_id'"
    return [f"{said} {node_id!r} is not a node id the coordinator accepts: it must be {NODE_ID_RULE}"]


def coordinator_problem(target: str) -> str | None:
    """Why ``target`` is not HOST:PORT to dial, or None. The port is 1..65535
    (gRPC would dial 443 for a missing one and another port for one past
    65535); an IPv6 address goes in brackets, as the coordinator's own
    listen addresses are written ([::1]:50051)."""
    host, sep, port = target.rpartition(":")
    if not sep or target.endswith("]"):
        return "no port"
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        return f"the port must be 1..65535, got {port!r}"
    if host.startswith("[") or host.endswith("]"):
        inner = host[1:-1] if host.startswith("[") and host.endswith("]") else ""
        if not inner or "[" in inner or "]" in inner or any(c.isspace() for c in inner):
            return f"{host!r} is not an address in brackets"
        return None
    if not host:
        return "no host"
    if any(c.isspace() or c in "/?#@[]" for c in host):  # a URI ("dns:///h:1"), a typo
        return f"{host!r} is not a host name or address"
    if ":" in host:
        return "an IPv6 address goes in brackets, as in [::1]:50051"
    return None


def _coordinator_problems(target: str, where: str, path: Path | None) -> list[str]:
    """A coordinator address that is not HOST:PORT, said (exit 2 at start:
    it was dialled as it came, retried for ever under systemd); [] if it is."""
    problem = coordinator_problem(target)
    if problem is None:
        return []
    said = "argument --coordinator:" if where.startswith("--") else f"{path}: option 'coordinator'"
    return [f"{said} {target!r} is not HOST:PORT ({problem})"]


def _label_problems(labels: dict[str, str], from_flags: dict[str, str], path: Path | None) -> list[str]:
    """Every label the coordinator refuses at registration, checked by its
    own rule (``validate_register``), said (exit 2 at start: found there, it
    was exit 78 after connecting, and a failed systemd unit): too many first,
    then each label refused. [] when it takes them."""
    if not labels:
        return []

    def said(key: str) -> str:
        if key in from_flags:
            return f"argument --label: {f'{key}={labels[key]}'!r}"
        return f"{path}: [agent.labels] {key!r} = {labels[key]!r}"

    def refusal(given: dict[str, str]) -> RegistrationError | None:
        """What the coordinator says of a registration valid but for ``given`` labels (ValueError: not UTF-8)."""
        probe = pb.Register(node_id="label-check", backend="sim",
                            gpus=[pb.GpuInfo(index=0, uuid="GPU-label-check", memory_total_mib=1)])
        for key, value in given.items():
            probe.labels[key] = value
        try:
            validate_register(probe)
        except RegistrationError as exc:
            if exc.field.startswith("register.labels"):  # else the probe's own fields: nothing the operator gave
                return exc
        return None

    problems = []
    # the labels as a whole, counted on stand-ins the rule takes: too many
    count = refusal({f"label-check-{i}": "" for i in range(len(labels))})
    if count is not None:
        rule = str(count)[len(count.field) + 2:]
        where = (f"--label and [agent.labels] in {path}" if path is not None and from_flags
                 else "--label" if from_flags else f"{path}: [agent.labels]")
        problems.append(f"{where}: {rule}: the coordinator refuses them at registration")
    for key, value in labels.items():  # then each one
        try:
            refused = refusal({key: value})
        except ValueError as exc:  # UnicodeEncodeError: bytes of no encoding on the command line
            problems.append(f"{said(key)}: not UTF-8 text ({exc})")
            continue
        if refused is not None:
            rule = str(refused)[len(refused.field) + 2:]
            problems.append(f"{said(key)} is a label the coordinator refuses at registration: {rule}")
    return problems


def _checked_option(key: str, value: Any, path: Path) -> Any:
    """A --config option's value, or ValueError whose text is the error line
    naming the option and file."""
    if key in _NUMBERS:
        if key == "sim_seed" and value is None:
            return value
        try:
            return _check_number(key, value)
        except ValueError as exc:
            raise ValueError(f"{path}: option {key!r} {exc}") from None
    if key in _CHOICES:
        if value not in _CHOICES[key]:
            raise ValueError(f"{path}: option {key!r} must be one of {', '.join(_CHOICES[key])}, got {value!r}")
        return value
    if key == "labels":
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise ValueError(f"{path}: [agent.labels] must map names to strings, got {value!r}")
        return dict(value)
    if not isinstance(value, str):
        raise ValueError(f"{path}: option {key!r} must be a string, got {value!r}")
    return value


def _read_token(settings: dict[str, Any]) -> str:
    """The agent's bearer token ("" without a token file); OSError if
    unreadable, ValueError (SecurityConfigError, UnicodeDecodeError) when the
    file holds no token gRPC can send (empty, the coordinator's digest file)."""
    if not settings["token_file"]:
        return ""
    from coordinator.security import read_token_file

    return read_token_file(settings["token_file"])


def _option(args: argparse.Namespace, key: str) -> str:
    """How the operator gave ``key``: its flag, else its name in --config."""
    if getattr(args, key, None) is not None or args.config is None:
        return "--" + key.replace("_", "-")
    return key


def _credentials(args: argparse.Namespace, settings: dict[str, Any]) -> tuple[str | None, list[str]]:
    """(what is wrong with the agent's own TLS files or token file, or None;
    warnings), checked at start: a key that is not the certificate's, a
    certificate expired or not yet valid, an unreadable file, a token file
    that holds no token would otherwise show only as handshakes failing
    ("Failed to create security handshaker", "Socket closed") retried forever."""
    if not any(settings[key] for key in ("ca_file", "cert_file", "key_file", "token_file")):
        return None, []
    from coordinator.security import SecurityConfigError, check_client_credentials

    warnings: list[str] = []
    try:
        warnings = check_client_credentials(
            settings["ca_file"], settings["cert_file"], settings["key_file"],
            options=(_option(args, "ca_file"), _option(args, "cert_file"), _option(args, "key_file")),
        )
    except SecurityConfigError as exc:
        keys = [key for key in ("ca_file", "cert_file", "key_file") if settings[key]]
        return _in_config(args, keys) + str(exc), warnings
    token_file = f"{_in_config(args, ['token_file'])}{_option(args, 'token_file')} {settings['token_file']}"
    try:
        _read_token(settings)
    except OSError as exc:
        return f"{token_file}: cannot read the token file: {exc.strerror or exc}", warnings
    except UnicodeDecodeError:
        return f"{token_file}: not a text file: it should hold the bearer token on one line", warnings
    except ValueError as exc:
        return f"{token_file}: {exc}", warnings
    return None, warnings


def _in_config(args: argparse.Namespace, keys: list[str]) -> str:
    """"CONFIG: " when one of ``keys`` came from --config, else ""."""
    return f"{args.config}: " if any(not _option(args, key).startswith("--") for key in keys) else ""


def build_backend(kind: str, *, gpus: int, seed: int, workload: str, node_id: str = "") -> GpuBackend:
    return open_backend(kind, gpus=gpus, seed=seed, workload=workload, node_id=node_id)[0]


def open_backend(kind: str, *, gpus: int, seed: int, workload: str, node_id: str = "") -> tuple[GpuBackend, str]:
    """The backend ``kind`` names, and NVML's error when ``auto`` fell back
    to simulated GPUs ("" otherwise): --check fails on that, where it passes
    the simulator asked for by name."""
    nvml_error = ""
    if kind in ("nvml", "auto"):
        try:
            from agent.nvml import NvmlBackend

            return NvmlBackend(), ""
        except BackendUnavailable as exc:
            if kind == "nvml":
                raise
            nvml_error = str(exc) or type(exc).__name__
            log.warning(
                "SIMULATING_GPUS",
                reason=f"NVML could not be used ({nvml_error}); this agent reports SIMULATED GPUs, not real ones",
            )
    from agent.sim import SimBackend

    return SimBackend(gpus=gpus, seed=seed, workload=workload, node_id=node_id), nvml_error


async def _run(settings: dict[str, Any]) -> int:
    seed = settings["sim_seed"]
    if seed is None:
        seed = sum(settings["node_id"].encode()) * 7919
    try:
        backend = build_backend(settings["backend"], gpus=settings["sim_gpus"], seed=seed, workload=settings["sim_workload"],
                                node_id=settings["node_id"])
    except BackendUnavailable as exc:
        log.error("backend_unavailable", backend=settings["backend"], error=str(exc))
        return 2
    from agent.diskstats import DiskIoMonitor

    try:
        token = _read_token(settings)
    except (OSError, ValueError) as exc:
        log.error("token_file_unreadable", path=settings["token_file"], error=str(exc))
        return 2
    config = AgentConfig(
        node_id=settings["node_id"],
        coordinator=settings["coordinator"],
        labels=settings["labels"],
        interval_min_s=settings["interval_min"],
        interval_max_s=settings["interval_max"],
        outage_buffer_rounds=settings["outage_buffer"],
        ca_file=settings["ca_file"],
        cert_file=settings["cert_file"],
        key_file=settings["key_file"],
        token=token,
        token_file=settings["token_file"],
    )
    agent = Agent(config, backend, io_monitor=DiskIoMonitor())
    notifier = Notifier.from_environ(os.environ)
    pinger = WatchdogPinger(notifier)
    loop = asyncio.get_running_loop()

    def stop() -> None:
        notifier.stopping(status="stopping")
        asyncio.ensure_future(agent.stop())

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    # SIGHUP (a `kill -HUP`, or `pkill -HUP gpulb` meant for the coordinator)
    # had ended the agent silently, a clean exit to systemd: not restarted
    loop.add_signal_handler(signal.SIGHUP, _sighup)
    rewind = getattr(backend, "rewind_background", None)
    if rewind is not None:
        # The simulator only: SIGUSR1 replays the other tenants' load from its
        # start, so runs compared one after another (gpulb demo's policy
        # phases) meet the same load.
        def rewind_background() -> None:
            rewind()
            log.info("sim_background_rewound", node_id=config.node_id)

        loop.add_signal_handler(signal.SIGUSR1, rewind_background)
    driver = driver_version_of(backend)
    log.info("agent_starting", node_id=config.node_id, backend=backend.name, gpus=len(agent.gpu_order), coordinator=config.coordinator, pid=os.getpid(),
             **({"driver": driver} if driver else {}))
    pinger.start()
    status = asyncio.create_task(_report_status(agent, notifier, backend.name))
    reminders = asyncio.create_task(_remind_certificates(settings))
    try:
        await agent.run()
    finally:
        status.cancel()
        reminders.cancel()
        await pinger.stop()
        backend.close()
    for ended, exit_code, status, reason in (
        (agent.refused, EXIT_REFUSED, f"registration refused by {config.coordinator}",
         "the coordinator refused the registration"),
        (agent.reread_wanted, EXIT_REREAD, "GPUs read wrong, exiting for a fresh read",
         "the GPUs read wrong; a new process reads them again"),
    ):
        if ended is not None:
            code, detail = ended
            notifier.status(f"{status}: {code}: {detail}"[:400])
            log.error("agent_exiting", node_id=config.node_id, exit_code=exit_code, reason=f"{reason}: {code}: {detail}")
            return exit_code
    log.info("agent_stopped", node_id=config.node_id, envelopes=agent.stats.envelopes, bytes=agent.stats.bytes_sent)
    return 0


def _sighup() -> None:
    log.info("sighup", reloaded="nothing",
             detail="the agent reads its token file and TLS certificate files again at each connection to the "
                    "coordinator; any other change (agent.toml, flags) needs a restart: systemctl restart gpulb-agent")


async def _report_status(agent: Agent, notifier: Notifier, backend: str) -> None:
    """READY=1 once streaming - or after a bound, so that a coordinator that is
    down does not make systemd kill every agent at its start timeout (the
    agent keeps retrying, and says so in STATUS)."""
    try:
        await asyncio.wait_for(agent.connected.wait(), timeout=_READY_BOUND_S)
    except asyncio.TimeoutError:
        pass
    gpus = len(agent.gpu_order)
    notifier.ready(status=_status(agent, backend, gpus))
    while True:
        await asyncio.sleep(10)
        notifier.status(_status(agent, backend, gpus))


def _status(agent: Agent, backend: str, gpus: int) -> str:
    if agent.connected.is_set():
        return f"streaming {gpus} {backend} GPUs to {agent.config.coordinator}: {agent.stats.envelopes} envelopes, {agent.stats.bytes_sent} bytes"
    if agent.stats.last_error.startswith("ALREADY_EXISTS"):
        return f"{gpus} {backend} GPUs; registration refused by {agent.config.coordinator}, retrying: {agent.stats.last_error}"[:400]
    return f"{gpus} {backend} GPUs; coordinator {agent.config.coordinator} unreachable, retrying"


_READY_BOUND_S = 10.0

#: how often (s) a running agent reads its certificate files' dates again
CERTIFICATE_CHECK_S = 3600.0


async def _remind_certificates(settings: dict[str, Any]) -> None:
    """The start's warning again while the agent runs: a certificate that
    enters its last 14 days weeks into a stream's life fails nothing until
    the agent next connects (a coordinator restart, a network blip), and
    then every handshake fails. Said once a day per file, from the files on
    disk: a renewed file (taken at the next connection) ends it."""
    from coordinator.certwatch import ExpiryReminder

    files = [(option, settings[option]) for option in ("ca_file", "cert_file") if settings.get(option)]
    if not files:
        return
    reminder = ExpiryReminder()
    while True:
        await asyncio.sleep(CERTIFICATE_CHECK_S)
        remind_certificates(files, reminder)


def remind_certificates(files: list[tuple[str, str]], reminder, now_s: float | None = None) -> list[str]:
    """One check of ``files`` ((option, path) pairs): logs and returns the
    warnings due now (``ExpiryReminder``) and the files that cannot be read."""
    from coordinator.security import certificate_validity

    now_s = time.time() if now_s is None else now_s
    said = []
    for option, path in files:
        try:
            validity = certificate_validity(path)
        except (ValueError, OSError) as exc:
            detail = f"{option} {path}: cannot read the certificate: {exc}"
            log.error("tls_credentials_unusable", error=detail, detail="the next connection to the coordinator fails")
            said.append(detail)
            continue
        if validity is None:  # pragma: no cover - neither cryptography nor CPython's decoder
            continue
        warning = reminder.due(option, validity[1].timestamp(), now_s)
        if warning is not None:
            detail = f"{option} {path}: {'the CA certificate' if option == 'ca_file' else 'the certificate'} {warning}"
            log.warning("tls_certificate_expires_soon", detail=detail)
            said.append(detail)
    return said


def _check(settings: dict[str, Any], rounds: int, as_json: bool, no_coordinator: bool, credentials: str | None = None) -> int:
    from agent.check import check_coordinator, run_and_render

    seed = settings["sim_seed"] if settings["sim_seed"] is not None else 0
    try:
        backend, nvml_error = open_backend(settings["backend"], gpus=settings["sim_gpus"], seed=seed,
                                           workload=settings["sim_workload"], node_id=settings["node_id"])
    except BackendUnavailable as exc:
        print(f"check: FAIL: the {settings['backend']} backend cannot start: {exc}", file=sys.stderr)
        if as_json:  # a fleet script parsing stdout gets the one failure it most needs (QA pass 25)
            print(json.dumps({"ok": False, "backend": {"name": settings["backend"], "error": str(exc)}}, indent=2))
        return 2
    coordinator = None
    if not no_coordinator and credentials is not None:
        coordinator = (False, credentials)  # the agent's own TLS or token file (_credentials): the same words as a start
    elif not no_coordinator:
        try:
            token = _read_token(settings)
        except (OSError, ValueError) as exc:
            coordinator = (False, f"token_file unreadable: {exc}")
        else:
            coordinator = check_coordinator(
                settings["coordinator"], ca_file=settings["ca_file"], cert_file=settings["cert_file"],
                key_file=settings["key_file"], token=token,
            )
    try:
        return run_and_render(
            backend, rounds=rounds, interval_min_s=settings["interval_min"], as_json=as_json, coordinator=coordinator,
            nvml_error=nvml_error,
        )
    finally:
        backend.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = _settings(args)
    configure_logging(settings["log_level"], settings["log_format"])
    credentials, warnings = _credentials(args, settings)
    for warning in warnings:
        log.warning("tls_certificate_expires_soon", detail=warning)
    if args.check:
        return _check(settings, args.check_rounds, args.json, args.no_coordinator, credentials)
    if credentials is not None:
        _fail(credentials)
    return asyncio.run(_run(settings))


if __name__ == "__main__":
    sys.exit(main())
