# shellcheck shell=bash
# Sourced by scripts/*: creates or reuses the project's virtual environment and
# installs gpulb with its test extra when pyproject.toml changed since last time.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${GPULB_VENV:-$root/.venv}"
pick_python() {
  for candidate in python3.11 python3.12 python3.13 python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  echo "gpulb needs Python >= 3.11" >&2; return 1
}
if [ ! -x "$venv/bin/python" ]; then
  echo "creating virtual environment in $venv" >&2
  "$(pick_python)" -m venv "$venv"
fi
stamp="$venv/.gpulb-installed"
want="$(sha256sum < "$root/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "installing gpulb and its dependencies into $venv" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "${root}[test]"
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
