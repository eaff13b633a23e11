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
