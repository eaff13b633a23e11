"""The units' confinement without systemd: their seccomp filters, W^X
memory, and a launcher that puts a command under them.

``systemd/gpulb-agent.service`` (and the coordinator's likewise) allows the agent the system calls of
``SystemCallFilter=@system-service`` (refusing the rest with
``SystemCallErrorNumber=EPERM``), only the native ABI
(``SystemCallArchitectures=native``) and only the socket families of
``RestrictAddressFamilies=``. Whether the closed NVIDIA library, grpc's C
core and numpy live within that can only be learnt by running them under it,
and the GPU hosts the agent is tried on here have no systemd as PID 1. So this
module resolves the unit's lines to system call numbers where systemd is
installed (``systemd-analyze syscall-filter`` expands the groups as that
systemd version does; the kernel's ``asm/unistd_64.h`` numbers them), saves
that as JSON, and installs the same allow-list as a classic BPF seccomp
filter (``ProcessGroup.start(..., seccomp=...)``, ``benchmarks/real_gpu.py
--agent-seccomp``)::

    python -m coordinator.sandbox --unit systemd/gpulb-agent.service --out agent-seccomp.json

The confinement is applied by a launcher (``launcher_argv``): a small
standard-library program run with ``python -c`` that sets it up on its own
process and execs the command, which keeps it. Not a ``preexec_fn``:
Python code in a child forked from a process whose gRPC threads are busy
can die before it execs (gRPC's fork handler restarts its poller in the
child, and the child's closing of inherited descriptors pulls the poller's
epoll descriptor from under it: SIGABRT, 2 to 6 children in 150 in a
`/tmp` stress test, once in a CI run of the suite). It costs one bare
interpreter start.

Left out, as not what decides whether the agent runs: the argument filters
systemd adds for ``LockPersonality=``, ``RestrictNamespaces=`` and
``RestrictRealtime=`` (they refuse calls the agent never makes), and the
mount, device-cgroup and capability settings, which are not seccomp.
"""

from __future__ import annotations

import argparse
import errno as errno_mod
import json
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

UNISTD_64 = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
_FAMILIES = {"AF_UNIX": 1, "AF_LOCAL": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16, "AF_PACKET": 17}

# struct seccomp_data: nr, arch, instruction pointer, then the six arguments
_NR, _ARCH, _ARG0 = 0, 4, 16
_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_SYSCALL_BIT = 0x40000000
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_RET_LOG = 0x7FFC0000  # allow, and the kernel logs the call (audit type 1326)
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06


class SandboxError(RuntimeError):
    """The unit cannot be resolved here, or the filter cannot be installed."""


@dataclass
class UnitSeccomp:
    """A unit's seccomp settings resolved for x86_64: the allowed system
    calls by name and number, the errno the rest get, and the allowed
    socket families (empty: any)."""

    syscalls: dict[str, int]
    errno: int = errno_mod.EPERM
    families: list[int] = field(default_factory=list)
    source: str = ""

    def to_json(self) -> str:
        return json.dumps({"arch": "x86_64", "source": self.source, "errno": self.errno,
                           "families": self.families, "syscalls": dict(sorted(self.syscalls.items()))}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "UnitSeccomp":
        raw = json.loads(text)
        if raw.get("arch") != "x86_64":
            raise SandboxError(f"arch: only x86_64 filters are built, not {raw.get('arch')!r}")
        return cls(syscalls={str(k): int(v) for k, v in raw["syscalls"].items()}, errno=int(raw["errno"]),
                   families=[int(f) for f in raw["families"]], source=str(raw.get("source", "")))

    def program(self, log_only: bool = False) -> list[tuple[int, int, int, int]]:
        """The classic BPF program, as (code, jt, jf, k) rows: another ABI or
        an x32 call gets the errno; ``socket`` is allowed for the listed
        families only (EAFNOSUPPORT otherwise, as systemd answers); then one
        equality test per allowed call; anything else gets the errno.
        ``log_only``: what would be refused is allowed and logged by the
        kernel instead (``SECCOMP_RET_LOG``), so one run lists every call a
        program would miss under the unit, where a refusal would stop it at
        the first."""
        deny = _RET_K, 0, 0, _RET_LOG if log_only else _RET_ERRNO | (self.errno & 0xFFFF)
        allow = _RET_K, 0, 0, _RET_ALLOW
        prog = [(_LD_W_ABS, 0, 0, _ARCH), (_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64), deny,
                (_LD_W_ABS, 0, 0, _NR), (_JGE_K, 0, 1, _X32_SYSCALL_BIT), deny]
        socket_nr = self.syscalls.get("socket")
        if self.families and socket_nr is not None:
            n = len(self.families)
            # the socket block: load the family, one test per allowed one
            # (jumping to the allow after the refusal), refuse, allow; any
            # other call jumps past it with its number still loaded
            prog.append((_JEQ_K, 0, n + 3, socket_nr))
            prog.append((_LD_W_ABS, 0, 0, _ARG0))
            for i, fam in enumerate(self.families):
                prog.append((_JEQ_K, n - i, 0, fam))
            prog.append((_RET_K, 0, 0, _RET_LOG if log_only else _RET_ERRNO | errno_mod.EAFNOSUPPORT))
            prog.append(allow)
        for nr in sorted(set(self.syscalls.values())):
            prog.append((_JEQ_K, 0, 1, nr))
            prog.append(allow)
        prog.append(deny)
        if len(prog) > 4096:  # BPF_MAXINSNS
            raise SandboxError(f"the filter has {len(prog)} instructions, more than the kernel's 4096")
        return prog

    def program_bytes(self, log_only: bool = False) -> bytes:
        """The program as the kernel takes it (``struct sock_filter`` rows)."""
        return b"".join(struct.pack("=HBBI", *row) for row in self.program(log_only))


# The launcher: confines the process it runs in, then execs the command, so
# what it set up holds for the command (PR_SET_PDEATHSIG, PR_SET_MDWE and a
# seccomp filter are all kept across exec). Standard library only, and run
# with -c in isolated mode (-I: no current directory or PYTHON* variables on
# its path; the command still gets the environment), so any interpreter the
# command's user may run can run it, without this package on its path. argv: parent pid or "-", "wx" or "-", the filter
# as hex or "-", then the command.
_LAUNCHER = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
def fail(what):
    err = ctypes.get_errno()
    sys.exit(f"gpulb launcher: {what}: {os.strerror(err)}")
parent, wx, program, command = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
if parent != "-":
    libc.prctl(1, 15, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGTERM
    if os.getppid() != int(parent):
        sys.exit("gpulb launcher: the parent is gone")
if wx != "-" and libc.prctl(65, 1, 0, 0, 0) != 0:  # PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN
    fail("PR_SET_MDWE (needs Linux >= 6.3)")
if program != "-":
    rows = bytes.fromhex(program)
    buf = ctypes.create_string_buffer(rows, len(rows))
    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    fprog = SockFprog(len(rows) // 8, ctypes.addressof(buf))
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        fail("PR_SET_NO_NEW_PRIVS")
    if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        fail("PR_SET_SECCOMP")
try:
    os.execvp(command[0], command)
except OSError as exc:
    sys.exit(f"gpulb launcher: cannot run {command[0]}: {exc}")
"""


def _is_python(path: str) -> bool:
    return re.fullmatch(r"python[0-9.]*", os.path.basename(path)) is not None


def launcher_argv(argv: list[str], *, die_with_parent_pid: int | None = None, write_xor_execute: bool = False,
                  seccomp: "UnitSeccomp | None" = None, log_only: bool = False) -> list[str]:
    """``argv`` run through the launcher (module docstring), which confines
    its own process and execs ``argv``: dies with ``die_with_parent_pid``
    (the caller's pid), then W^X memory (``MemoryDenyWriteExecute=yes``,
    Linux >= 6.3), then ``seccomp``'s filter (last, so it need allow nothing
    of the set-up; ``log_only``: its diagnostic form). The launcher runs in
    the interpreter ``argv`` names when that is a Python (so a user who may
    run only that one can run it), else in this one. ``argv`` unchanged when
    nothing is asked for."""
    if die_with_parent_pid is None and not write_xor_execute and seccomp is None:
        return list(argv)
    if seccomp is not None and platform.machine() != "x86_64":
        raise SandboxError(f"the filter is for x86_64; this machine is {platform.machine()}")
    python = argv[0] if _is_python(argv[0]) else sys.executable
    return [python, "-I", "-c", _LAUNCHER, str(die_with_parent_pid) if die_with_parent_pid is not None else "-",
            "wx" if write_xor_execute else "-", seccomp.program_bytes(log_only).hex() if seccomp is not None else "-",
            *argv]


def _unit_settings(unit: Path) -> dict[str, list[str]]:
    """The [Service] lines of a unit, name -> values in order (a setting
    given twice accumulates, as systemd merges list settings; an empty
    assignment resets it, as in systemd)."""
    settings: dict[str, list[str]] = {}
    section = ""
    for line in unit.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        if section == "[Service]" and "=" in line:
            key, _, value = line.partition("=")
            if value.strip():
                settings.setdefault(key.strip(), []).append(value.strip())
            else:
                settings[key.strip()] = []
    return settings


def _expand(name: str, analyze: str, seen: set[str] | None = None) -> set[str]:
    """A systemd syscall group resolved to call names, recursively, as
    ``systemd-analyze syscall-filter`` lists it; a plain name stands for
    itself."""
    if not name.startswith("@"):
        return {name}
    seen = set() if seen is None else seen
    if name in seen:
        return set()
    seen.add(name)
    proc = subprocess.run([analyze, "syscall-filter", "--no-pager", name], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SandboxError(f"systemd-analyze syscall-filter {name}: {proc.stderr.strip()}")
    members = [ln.strip() for ln in proc.stdout.splitlines()[1:] if ln.strip() and not ln.strip().startswith("#")]
    names: set[str] = set()
    for member in members:
        names |= _expand(member, analyze, seen)
    return names


def syscall_numbers(header: Path = UNISTD_64) -> dict[str, int]:
    """x86_64 system call numbers by name, from the kernel headers."""
    if not header.exists():
        raise SandboxError(f"{header} is missing (Debian: apt install linux-libc-dev)")
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"#define __NR_(\w+)\s+(\d+)", header.read_text())}


def from_unit(unit: Path, analyze: str | None = None, header: Path = UNISTD_64) -> UnitSeccomp:
    """Resolve a unit's ``SystemCallFilter=`` (an allow-list),
    ``SystemCallErrorNumber=`` and ``RestrictAddressFamilies=`` for x86_64.
    Names this architecture lacks (``arm_fadvise64_64``, the 32-bit
    ``*_time64`` calls) are dropped, as systemd drops them."""
    analyze = analyze or shutil.which("systemd-analyze")
    if analyze is None:
        raise SandboxError("systemd-analyze is needed to expand the unit's syscall groups (apt install systemd)")
    s = _unit_settings(unit)
    filters = " ".join(s.get("SystemCallFilter", [])).split()
    if not filters:
        raise SandboxError(f"{unit}: no SystemCallFilter=")
    if any(f.startswith("~") for f in filters):
        raise SandboxError(f"{unit}: SystemCallFilter= deny-lists (~) are not resolved here, only allow-lists")
    names: set[str] = set()
    for f in filters:
        names |= _expand(f, analyze)
    names |= _expand("@default", analyze)  # systemd adds @default to every allow-list
    numbers = syscall_numbers(header)
    err_name = (s.get("SystemCallErrorNumber") or ["EPERM"])[-1]
    err = getattr(errno_mod, err_name, None)
    if err is None:
        raise SandboxError(f"{unit}: SystemCallErrorNumber={err_name} is not an errno name")
    families = []
    for fam in " ".join(s.get("RestrictAddressFamilies", [])).split():
        if fam not in _FAMILIES:
            raise SandboxError(f"{unit}: RestrictAddressFamilies= {fam} is not one this module knows")
        families.append(_FAMILIES[fam])
    version = subprocess.run([analyze, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    return UnitSeccomp(syscalls={n: numbers[n] for n in names if n in numbers}, errno=err,
                       families=sorted(set(families)), source=f"{unit.name}, {version}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--unit", type=Path, default=Path(__file__).resolve().parents[1] / "systemd" / "gpulb-agent.service",
                   help="the unit whose filter to resolve (default: this repository's agent unit)")
    p.add_argument("--out", type=Path, required=True, help="the JSON to write (for real_gpu.py --agent-seccomp)")
    args = p.parse_args(argv)
    try:
        spec = from_unit(args.unit)
    except SandboxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out.write_text(spec.to_json())
    print(f"{args.out}: {len(spec.syscalls)} system calls allowed, the rest {errno_mod.errorcode[spec.errno]}; "
          f"socket families {spec.families or 'any'}; {len(spec.program())} BPF instructions ({spec.source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
