"""The committed generated code must be what scripts/codegen makes from the
.proto files today; a stale checkout fails here, not in production."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_is_current(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run([str(ROOT / "scripts" / "codegen"), str(tmp_path)], check=True, env=env, cwd=ROOT)
    generated = sorted(p.name for p in (tmp_path / "protos").iterdir())
    assert generated, "codegen produced nothing"
    stale = [
        name for name in generated
        if not (ROOT / "protos" / name).exists()
        or (ROOT / "protos" / name).read_bytes() != (tmp_path / "protos" / name).read_bytes()
    ]
    assert not stale, f"out of date with protos/*.proto, run scripts/codegen: {stale}"


def test_every_proto_field_documents_its_meaning():
    # Every field line in the .proto files carries a trailing comment (its unit
    # or meaning), or sits under a comment line.
    missing = []
    for proto in sorted((ROOT / "protos").glob("*.proto")):
        lines = proto.read_text().splitlines()
        for number, line in enumerate(lines):
            stripped = line.strip()
            is_field = stripped.endswith(";") and "=" in stripped and not stripped.startswith(("option", "syntax", "package", "//", "rpc"))
            if not is_field or stripped.split()[0].isupper():
                continue  # enum values are self-describing names
            previous = lines[number - 1].strip() if number else ""
            if "//" not in line and not previous.startswith("//"):
                missing.append(f"{proto.name}:{number + 1}: {stripped}")
    assert not missing, "fields without a comment:\n" + "\n".join(missing)
