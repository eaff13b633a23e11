"""Shared pytest set-up."""

from __future__ import annotations

import ast
import functools
import gc
import sys

# CPython 3.11.5-3.11.7 raise a false "SystemError: AST constructor recursion
# depth mismatch" from ast.parse when a garbage collection runs finalizers of
# grpc's Cython objects in the middle of the parse (fixed upstream in 3.11.8).
# pytest parses source with ast.parse for assertion rewriting and tracebacks;
# keeping the collector out of ast.parse sidesteps the bug.
if (3, 11, 5) <= sys.version_info[:3] < (3, 11, 8):
    _original_parse = ast.parse

    @functools.wraps(_original_parse)
    def _parse_without_gc(*args, **kwargs):
        enabled = gc.isenabled()
        gc.disable()
        try:
            return _original_parse(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    ast.parse = _parse_without_gc


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def aot_build(tmp_path_factory):
    """The set search compiled ahead of time (``gpulb set-search build``),
    once per session, in a directory of its own (use it with GPULB_AOT_DIR);
    skipped where numba or a C compiler is missing."""
    import importlib.util
    import os
    import shutil
    import subprocess

    if importlib.util.find_spec("numba") is None or shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("numba or a C compiler is missing")
    out = tmp_path_factory.mktemp("aot")
    result = subprocess.run([sys.executable, "-m", "coordinator.cli", "set-search", "build", "--out", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return out
