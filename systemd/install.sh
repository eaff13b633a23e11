#!/usr/bin/env bash
# Install gpulb as systemd services on this host: the unprivileged gpulb
# user, a virtual environment in /opt/gpulb with the entry points linked into
# /usr/local/bin, the two units, and the configuration in /etc/gpulb.
#
# Idempotent: a re-run upgrades the package and the units, and keeps every
# file an operator may have edited in /etc/gpulb. Nothing is enabled or
# started; the last lines say how.
#
# usage: systemd/install.sh [--dry-run] [--source DIR|SPEC] [--python PYTHON] [--root DIR]
#   --dry-run   print each step (as a shell command) instead of running it
#   --source    what pip installs (default: the repository holding this script)
#   --python    interpreter for the virtual environment, >= 3.11 (default: python3)
#   --root      stage the files (units, configuration, entry-point links) into
#               DIR as if it were / (packaging). The virtual environment, the
#               user and group and systemctl belong to the target host (a venv
#               cannot move: its scripts name the path it was built at); the
#               last lines print the commands to run there
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dry_run=0
source_spec=$(dirname "$here")
python=python3
root=""

while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --source) source_spec=${2:?--source needs a value}; shift ;;
        --python) python=${2:?--python needs a value}; shift ;;
        --root) root=${2:?--root needs a value}; shift ;;
        -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "install.sh: unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

prefix=/opt/gpulb                      # where the units' binaries really live
bin_dir=$root/usr/local/bin
etc_dir=$root/etc/gpulb
unit_dir=$root/etc/systemd/system
venv=$prefix                           # built here only when installing into / (--root: on the target)

# Every change to the system goes through run, so --dry-run shows exactly the
# commands a real run would execute, quoted so they can be pasted.
run() {
    if [ "$dry_run" = 1 ]; then
        printf '+'
        printf ' %q' "$@"
        printf '\n'
    else
        "$@"
    fi
}

note() { printf '# %s\n' "$*"; }

if [ "$dry_run" = 0 ] && [ -z "$root" ] && [ "$(id -u)" != 0 ]; then
    echo "install.sh: run as root (or with --dry-run to see the steps)" >&2
    exit 1
fi

if [ -z "$root" ] && ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "install.sh: $python is missing or older than 3.11 (gpulb needs tomllib); pass --python" >&2
    [ "$dry_run" = 1 ] || exit 1
fi

# ---- user and group -----------------------------------------------------------
if [ -n "$root" ]; then
    note "--root: the gpulb user and group are created on the target host"
else
    if getent group gpulb >/dev/null; then
        note "group gpulb exists"
    else
        run groupadd --system gpulb
    fi
    if getent passwd gpulb >/dev/null; then
        note "user gpulb exists"
    else
        run useradd --system --gid gpulb --home-dir /var/lib/gpulb --no-create-home \
            --shell /usr/sbin/nologin --comment "gpulb daemons" gpulb
    fi
fi

# ---- package ----------------------------------------------------------------------
# A virtual environment is tied to the path it was built at (its entry points'
# shebangs, pyvenv.cfg's interpreter), so with --root it is not built into the
# staging tree: the closing lines say how to build it on the target.
if [ -n "$root" ]; then
    note "--root: the virtual environment $venv is built on the target host (commands at the end)"
else
    if [ -x "$venv/bin/python" ]; then
        note "virtual environment $venv exists"
    else
        run "$python" -m venv "$venv"
    fi
    run "$venv/bin/python" -m pip install --quiet --upgrade "$source_spec"
    # The multi-GPU set search, compiled ahead of time: it loads under the
    # coordinator's MemoryDenyWriteExecute=yes, where numba's JIT cannot, and
    # keeps LLVM out of the daemon. It needs a C compiler and the Python headers;
    # without them the coordinator runs the numpy path (same placements, slower).
    if [ "$dry_run" = 1 ]; then
        run "$venv/bin/gpulb" set-search build
    elif ! "$venv/bin/gpulb" set-search build; then
        note "could not build the set search ahead of time (a C compiler and Python headers are needed); the coordinator will use numpy"
    fi
fi
# the links name the final path: with --root they resolve once the target has the venv
run install -d -m 0755 "$bin_dir"
for exe in gpulb gpulb-coordinator gpulb-agent; do
    run ln -sfn "$prefix/bin/$exe" "$bin_dir/$exe"
done

# ---- configuration: installed once, then the operator's -------------------------
run install -d -m 0755 "$etc_dir"
group_opt=()
[ -n "$root" ] || group_opt=(-g gpulb)
for file in coordinator.toml agent.toml coordinator.env agent.env; do
    if [ -e "$etc_dir/$file" ]; then
        note "keeping $etc_dir/$file"
        continue
    fi
    case "$file" in
        # may hold tokens: readable by the daemons' group only
        *.env) run install -m 0640 "${group_opt[@]}" "$here/$file" "$etc_dir/$file" ;;
        *) run install -m 0644 "$here/$file" "$etc_dir/$file" ;;
    esac
done

# ---- units: ours, replaced on upgrade (local changes belong in drop-ins) ---------
run install -d -m 0755 "$unit_dir"
for unit in gpulb-coordinator.service gpulb-agent.service; do
    run install -m 0644 "$here/$unit" "$unit_dir/$unit"
done
if [ -n "$root" ]; then
    note "--root: run 'systemctl daemon-reload' on the target host"
elif [ "$dry_run" = 1 ] || [ -d /run/systemd/system ]; then
    run systemctl daemon-reload
else
    note "systemd is not running here: run 'systemctl daemon-reload' once it is"
fi

# The commands below run on the host that runs gpulb, so they name the final
# paths (/etc/gpulb, /opt/gpulb), never the staging root.
if [ -n "$root" ]; then
    note "staged into $root as the target's /: copy it there, then on the target host, as root:"
    note "  getent group gpulb >/dev/null || groupadd --system gpulb"
    note "  getent passwd gpulb >/dev/null || useradd --system --gid gpulb --home-dir /var/lib/gpulb --no-create-home --shell /usr/sbin/nologin --comment 'gpulb daemons' gpulb"
    note "  chgrp gpulb /etc/gpulb/coordinator.env /etc/gpulb/agent.env"
    note "  $(printf '%q' "$python") -m venv $venv   (Python >= 3.11)"
    note "  $venv/bin/python -m pip install --upgrade $(printf '%q' "$source_spec")   (this source must be there: a copy of it, or a wheel built with pip wheel)"
    note "  $venv/bin/gpulb set-search build   (needs a C compiler and the Python headers; without them the coordinator uses numpy)"
    note "  systemctl daemon-reload"
    note "(or run systemd/install.sh there, as root: it does the same and keeps the staged /etc/gpulb files)"
fi
if [ -n "$root" ]; then note "once installed there, next:"; else note "installed. Next:"; fi
note "  coordinator host: systemctl enable --now gpulb-coordinator"
note "  GPU hosts:        $prefix/bin/gpulb-agent --config /etc/gpulb/agent.toml --check   (pre-flight: exit 0 = ready)"
note "                    systemctl enable --now gpulb-agent   (set coordinator in /etc/gpulb/agent.toml first)"
note "  effective config: $prefix/bin/gpulb-coordinator --config /etc/gpulb/coordinator.toml --print-config"
