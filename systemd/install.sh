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

# A usage error: one line and exit 2, as for an unknown argument (bash's own
# ${2:?} said "line 32: 2: --root needs a value" and exited 1).
usage_error() { echo "install.sh: $*" >&2; exit 2; }
# The value of option $1, given as $2: missing, empty or another option
# (`--root --dry-run`) is refused rather than taken as a path.
option_value() {
    case "${2-}" in
        ""|-*) usage_error "$1 needs a value (see --help)" ;;
    esac
}

while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --source) option_value "$1" "${2-}"; source_spec=$2; shift ;;
        --python) option_value "$1" "${2-}"; python=$2; shift ;;
        --root) option_value "$1" "${2-}"; root=$2; shift ;;
        -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) usage_error "unknown argument: $1 (see --help)" ;;
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
    if [ "$dry_run" = 1 ]; then
        note "dry run: nothing was staged; a real run stages into $root as the target's /: copy it there, then on the target host, as root:"
    else
        note "staged into $root as the target's /: copy it there, then on the target host, as root:"
    fi
    note "  getent group gpulb >/dev/null || groupadd --system gpulb"
    note "  getent passwd gpulb >/dev/null || useradd --system --gid gpulb --home-dir /var/lib/gpulb --no-create-home --shell /usr/sbin/nologin --comment 'gpulb daemons' gpulb"
    note "  chgrp gpulb /etc/gpulb/coordinator.env /etc/gpulb/agent.env"
    note "  $(printf '%q' "$python") -m venv $venv   (Python >= 3.11)"
    note "  $venv/bin/python -m pip install --upgrade $(printf '%q' "$source_spec")   (this source must be there: a copy of it, or a wheel built with pip wheel)"
    note "  $venv/bin/gpulb set-search build   (needs a C compiler and the Python headers; without them the coordinator uses numpy)"
    note "  systemctl daemon-reload"
    note "(or run systemd/install.sh there, as root: it does the same and keeps the staged /etc/gpulb files)"
fi
if [ -n "$root" ]; then
    note "once installed there, next:"
elif [ "$dry_run" = 1 ]; then
    note "dry run: nothing was installed. After a real run, next:"
else
    note "installed. Next:"
fi
# The shipped coordinator.toml has no TLS, no token file and insecure = false,
# a configuration the daemon refuses (exit 2, restarted by the unit every 2 s
# until systemd gives up): say what to add before enabling it.
note "  coordinator host: add to the [coordinator] table of /etc/gpulb/coordinator.toml (it refuses to start without TLS and a token file):"
note "                      tls_cert_file = \"/etc/gpulb/tls/coordinator.pem\""
note "                      tls_key_file = \"/etc/gpulb/tls/coordinator.key\""
note "                      token_file = \"/etc/gpulb/tokens.toml\"   (one [tokens.\"sha256:...\"] entry per client, as $prefix/bin/python -m coordinator.security new-token --role admin --name ops prints it; the token itself stays out of the file)"
note "                      listen = \"0.0.0.0:50051\"   (the default, 127.0.0.1:50051, serves this host only)"
note "                    the files readable by user gpulb (chgrp gpulb, mode 0640); or, on a lab network only, instead of TLS and tokens:"
note "                      insecure = true"
# What the unit runs: its user, its environment (GPULB_STATE_DIR from
# Environment=, then /etc/gpulb/coordinator.env, parsed as systemd parses it)
# and its ExecStart=. Without them --print-config showed state_dir "" (in
# memory) where the service keeps /var/lib/gpulb.
note "                    effective config, as the unit runs it: systemd-run --pipe --wait -p User=gpulb -p Environment=GPULB_STATE_DIR=/var/lib/gpulb -p EnvironmentFile=-/etc/gpulb/coordinator.env /usr/local/bin/gpulb-coordinator --config /etc/gpulb/coordinator.toml --print-config"
note "                    systemctl enable --now gpulb-coordinator"
# as the unit runs the agent (User=gpulb): a check as root can read what the service cannot
note "  GPU hosts:        sudo -u gpulb $prefix/bin/gpulb-agent --config /etc/gpulb/agent.toml --check   (pre-flight: exit 0 = ready)"
note "                    systemctl enable --now gpulb-agent   (set coordinator, and its CA and token, in /etc/gpulb/agent.toml first)"
