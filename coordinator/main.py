"""``gpulb-coordinator``: the cluster daemon. Serves agents, clients and
operators on one gRPC port until SIGTERM, then stops gracefully.

Configuration: one TOML file (``--config``), ``GPULB_*`` environment variables
and flags, validated before anything starts (``--print-config`` shows the
result). Under systemd it speaks sd_notify: READY=1 once listening, WATCHDOG=1
pings from the event loop, STATUS= lines, RELOADING=1 on SIGHUP (which
re-reads the configuration and applies what can change live) and STOPPING=1.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import sys

import structlog

from coordinator.config import LIVE_RELOADABLE
from coordinator.sdnotify import Notifier, WatchdogPinger
from coordinator.security import (
    RateLimiter,
    Security,
    SecurityConfigError,
    ServerCredentialsConfig,
    TenantQuota,
    TokenAuth,
    token_problem,
)
from coordinator.server import Coordinator, ListenError
from coordinator.state import StateError, open_state_dir, state_dir_problem
from coordinator.settings import (
    ConfigError,
    Settings,
    add_settings_flags,
    diff_settings,
    flag_overrides,
    load_settings,
    render_settings,
)
from protos.runtime import configure_logging

__all__ = ["main", "build_parser"]

log = structlog.get_logger("gpulb.coordinator")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpulb-coordinator", description="The gpulb coordinator: global GPU view and scheduler.")
    add_settings_flags(parser)
    return parser


class TokenFileError(SecurityConfigError):
    """The ``token_file`` (the bearer-token digests) cannot be used."""


#: the CLI's client token file: exported for ``gpulb``, the coordinator reads it as ``token_file``
_CLI_TOKEN_VARIABLE = "GPULB_TOKEN_FILE"


def token_file_problem(exc: SecurityConfigError, settings: Settings) -> str:
    """``exc`` (the token file refused) with where ``token_file`` came from,
    and the likely mix-up behind it: ``GPULB_TOKEN_FILE`` is also the gpulb
    CLI's client token file, so a shell that exported it for the CLI hands
    the coordinator a client's bearer token as its digest file."""
    source = settings.sources.get("coordinator.token_file", "default")
    kind, _, detail = source.partition(":")
    said = {"env": f"the environment variable {detail}", "flag": "the flag --token-file",
            "file": f"token_file in the config file {detail}"}.get(kind, "token_file")
    parts = [f"token_file (from {said}): {exc}"]
    if _looks_like_a_client_token(settings.coordinator.token_file):
        parts.append("the file looks like a client's bearer token (one line), not the coordinator's token digest "
                     "file ([tokens.\"sha256:...\"] entries)")
    if source == f"env:{_CLI_TOKEN_VARIABLE}":
        parts.append(f"{_CLI_TOKEN_VARIABLE} is also the gpulb CLI's client token file: unset it for the coordinator "
                     f"(e.g. `env -u {_CLI_TOKEN_VARIABLE} gpulb-coordinator ...`) and give the coordinator its digest "
                     f"file as token_file in its config file, or with --token-file (which overrides the variable)")
    return "; ".join(parts)


def _looks_like_a_client_token(path: str) -> bool:
    """One line of what a bearer token is made of (no spaces, none of TOML's
    or JSON's ``=``, brackets or quotes: base64 padding aside)."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read(4096).strip()
    except (OSError, UnicodeDecodeError):
        return False
    return token_problem(text) is None and not any(c in text.rstrip("=") for c in "=[]{}\"'")


def build_security(cfg) -> Security:
    """TLS, tokens and limits from the configuration. Without TLS and tokens the
    daemon refuses to start unless ``insecure`` was asked for."""
    tls = None
    if cfg.tls_cert_file or cfg.tls_key_file:
        tls = ServerCredentialsConfig(
            cert_file=cfg.tls_cert_file,
            key_file=cfg.tls_key_file,
            client_ca_file=cfg.tls_client_ca_file or None,
            require_client_cert_for_agents=bool(cfg.tls_client_ca_file),
        )
    try:
        tokens = TokenAuth.from_file(cfg.token_file) if cfg.token_file else None
    except SecurityConfigError as exc:
        raise TokenFileError(str(exc)) from None
    return Security(
        tokens=tokens,
        tls=tls,
        insecure=cfg.insecure,
        rate_limit=RateLimiter(cfg.rpc_rate_per_s, cfg.rpc_burst) if cfg.rpc_rate_per_s > 0 else None,
        stream_rate=(cfg.stream_message_rate_per_s, cfg.stream_message_burst) if cfg.stream_message_rate_per_s > 0 else None,
        quota=TenantQuota(cfg.max_queued_per_tenant or None),
    )


class _Daemon:
    def __init__(self, settings: Settings, config_path: str | None, overrides: dict, security: Security) -> None:
        self.settings = settings
        #: the settings the process started with: options that need a restart keep these
        self.started = settings
        self.config_path = config_path
        self.overrides = overrides
        self.notifier = Notifier.from_environ(os.environ)
        cfg = settings.coordinator
        store = open_state_dir(cfg.state_dir, synchronous=cfg.state_synchronous, background_checkpoint_s=1.0) if cfg.state_dir else None
        self.coordinator = Coordinator(
            cfg, settings.scheduler, security=security, store=store,
            advisor_config=settings.advisor, predictor_config=settings.predictor,
            growth_config=settings.memory_growth,
        )
        self.stop_requested = asyncio.Event()
        #: the config file's own values at the last read (``_shadowed_file_edits``)
        self._file_settings = None
        self._shadowed_file_edits(settings)
        self._status_task: asyncio.Task | None = None

    def status_line(self) -> str:
        c = self.coordinator
        summary = c.dispatcher.engine
        nodes = len(c.view.nodes)
        gpus = sum(len(n.gpus) for n in c.view.nodes.values())
        return f"{nodes} nodes, {gpus} GPUs, {len(c.gateway.sessions)} streams, {summary.queued()} queued, {summary.placed} placed, policy {summary.get_policy().name}"

    async def _status_loop(self) -> None:
        while True:
            await asyncio.sleep(10)
            self.notifier.status(self.status_line())

    def reload(self) -> None:
        """SIGHUP: re-read the configuration, apply what can change live, say what changed."""
        self.notifier.reloading()
        metrics = self.coordinator.metrics
        try:
            new = load_settings(self.config_path, os.environ, self.overrides)
        except ConfigError as exc:
            log.error("reload_rejected", error=str(exc), kept="the running configuration")
            metrics.reload_successful.set(0)
            self.notifier.ready(status=f"reload rejected: {exc}")
            return
        def live(name: str) -> bool:
            section, _, option = name.partition(".")
            return section in ("scheduler", "advisor") or option in LIVE_RELOADABLE

        applied = [(name, old, value) for name, old, value in diff_settings(self.settings, new) if live(name)]
        # against what runs, not the last reload: a listen address changed two
        # reloads ago still differs from the port bound, and is said again
        needs_restart = [name for name, _, _ in diff_settings(self.started, new) if not live(name)]
        try:
            self.coordinator.apply_settings(new.coordinator, new.scheduler, [n for n, _, _ in applied], advisor_config=new.advisor)
        except Exception as exc:  # a value valid in the file but refused live
            log.error("reload_rejected", error=str(exc), kept="the running configuration")
            metrics.reload_successful.set(0)
            self.notifier.ready(status=f"reload rejected: {exc}")
            return
        if new.coordinator.log_level != self.settings.coordinator.log_level:
            configure_logging(new.coordinator.log_level, new.coordinator.log_format)
        self.reload_tokens(new.coordinator.token_file)
        self.settings = new
        metrics.reload_successful.set(1)
        metrics.reload_success_time.set_to_current_time()
        overridden = self._shadowed_file_edits(new)
        # an operator edited the file and reloaded: say when something will not
        # happen (it needs a restart, or a variable or flag wins over the file)
        (log.warning if needs_restart or overridden else log.info)(
            "configuration_reloaded",
            changed={name: {"from": old, "to": value} for name, old, value in applied},
            restart_needed_for=needs_restart or None,
            overridden=overridden or None,
        )
        self.notifier.ready(status=f"reloaded: {len(applied)} settings changed" + (f", {len(needs_restart)} need a restart" if needs_restart else ""))

    def _shadowed_file_edits(self, new) -> dict[str, str]:
        """Options whose value in the file changed since the last read but do
        not apply, because an environment variable or a flag sets them (the
        documented precedence, which a reload that logs ``changed: {}`` hides):
        option -> what wins."""
        try:
            in_file = load_settings(self.config_path, {}, {}) if self.config_path else None
        except ConfigError:
            in_file = None
        before, self._file_settings = self._file_settings, in_file
        if in_file is None or before is None:
            return {}
        return {name: new.sources.get(name, "?") for name, _, value in diff_settings(before, in_file)
                if new.sources.get(name, "").partition(":")[0] in ("env", "flag")}

    def reload_tokens(self, token_file: str) -> None:
        """SIGHUP: read the token file again, so a tenant's token is added or
        a leaked one revoked without a restart (which would drop every agent
        stream and waiting call). Its path is fixed at start; a file that
        does not load keeps the tokens served before."""
        security = self.coordinator.security
        running = self.started.coordinator.token_file
        if not running or security.tokens is None or token_file != running:
            return  # no token file, or a new path: restart_needed_for says so
        try:
            tokens = TokenAuth.from_file(running)
        except SecurityConfigError as exc:
            log.error("token_file_reload_refused", error=str(exc), kept=f"the {len(security.tokens)} tokens served before")
            return
        added = tokens.names_not_in(security.tokens)
        outcome = self.coordinator.reload_tokens(tokens)
        if added or outcome["revoked"]:
            log.info("tokens_reloaded", token_file=running, added=added, **outcome)

    async def run(self) -> int:
        try:
            port = await self.coordinator.start()
        except ListenError as exc:
            # another coordinator on the port, an address not of this host: one
            # line naming the option, and the start undone (Coordinator.start)
            log.error("listen_failed", option=exc.option, address=exc.address, error=exc.reason)
            self.notifier.status(f"not started: {exc}")
            return 2
        except SecurityConfigError as exc:  # TLS files are read when the ports are bound
            log.error("tls_unavailable", error=str(exc))
            self.notifier.status(f"not started: {exc}")
            return 2
        except StateError as exc:  # the stored tasks cannot be read (a damaged page)
            log.error("state_unavailable", state_dir=self.settings.coordinator.state_dir, error=str(exc))
            self.notifier.status(f"not started: {exc}"[:400])
            return 2
        pinger = WatchdogPinger(self.notifier)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_requested.set)
        self.notifier.ready(status=f"listening on port {port}")
        pinger.start()
        self._status_task = asyncio.create_task(self._status_loop())
        await self.stop_requested.wait()
        log.info("coordinator_stopping", grace_s=self.settings.coordinator.grace_s)
        self.notifier.stopping(status="stopping: closing streams and flushing state")
        self._status_task.cancel()
        await pinger.stop()
        await self.coordinator.stop()
        return 0


def _security_or_problem(args: argparse.Namespace, settings) -> tuple[Security | None, str | None]:
    """(the daemon's Security, None), or (None, why it cannot start with it)."""
    try:
        return build_security(settings.coordinator), None
    except TokenFileError as exc:
        return None, token_file_problem(exc, settings)
    except SecurityConfigError as exc:
        return None, f"{args.config or 'flags/environment'}: {exc}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = flag_overrides(args)
    try:
        settings = load_settings(args.config, os.environ, overrides)
    except ConfigError as exc:
        print(f"gpulb-coordinator: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(render_settings(settings))
        # as `nginx -t` does: a configuration shown is one the daemon would
        # start with, or it says why not (TLS and tokens, or insecure; files
        # that cannot be read), exit 2; it exited 0 on one the daemon refused
        import structlog.testing

        with structlog.testing.capture_logs():  # its warnings are the daemon's to log, not on stdout
            _, problem = _security_or_problem(args, settings)
        if problem is None and settings.coordinator.state_dir:
            problem = state_dir_problem(settings.coordinator.state_dir)
        for warning in settings.warnings:  # what the daemon would log at start (a misspelt variable)
            print(f"gpulb-coordinator: warning: {warning}", file=sys.stderr)
        if problem is not None:
            print(f"gpulb-coordinator: this configuration would not start: {problem}", file=sys.stderr)
            return 2
        return 0
    configure_logging(settings.coordinator.log_level, settings.coordinator.log_format)
    for warning in settings.warnings:
        log.warning("config_warning", message=warning)
    security, problem = _security_or_problem(args, settings)
    if problem is not None:
        print(f"gpulb-coordinator: {problem}", file=sys.stderr)
        return 2

    async def run() -> int:
        try:
            daemon = _Daemon(settings, args.config, overrides, security)
        except (StateError, OSError) as exc:
            log.error("state_unavailable", state_dir=settings.coordinator.state_dir, error=str(exc))
            return 2
        return await daemon.run()

    tune_gc(settings.coordinator.gc_gen0_threshold)
    try:
        runner, loop_name = event_loop_runner(settings.coordinator.event_loop)
    except ImportError as exc:
        print(f"gpulb-coordinator: event_loop: {exc}", file=sys.stderr)
        return 2
    log.info("runtime", event_loop=loop_name, gc_threshold=gc.get_threshold())
    return runner(run())


def tune_gc(gen0_threshold: int) -> None:
    """Young-generation GC every ``gen0_threshold`` allocations (the older
    generations keep Python's ratios). The coordinator holds a large heap of
    long-lived objects (nodes, GPUs, tasks) and allocates fast while it
    ingests; at Python's 700 the collector ran ~50 times a second at 2,500
    streams and its full passes stalled the event loop ~300 ms each, which
    was the ingest p99 (measured in `gpulb bench ingest`: p99 86-99 ms
    before, 49-50 ms after). 0 keeps Python's default."""
    if gen0_threshold > 0:
        _, gen1, gen2 = gc.get_threshold()
        gc.set_threshold(gen0_threshold, gen1, gen2)


def event_loop_runner(choice: str):
    """(``asyncio.run``-like runner, its name) for ``event_loop``: uvloop
    (libuv) runs grpc.aio with less loop overhead per message; "auto" takes
    it when installed. ImportError when "uvloop" is asked for and missing."""
    if choice in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise ImportError("uvloop was asked for but is not installed (pip install uvloop)") from None
        else:
            return uvloop.run, "uvloop"
    return asyncio.run, "asyncio"


if __name__ == "__main__":
    sys.exit(main())
