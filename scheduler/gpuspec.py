"""The ``gpu_spec`` model constraint: its grammar and how it matches GPU model names.

Grammar: ``alternative ("|" alternative)*``; an alternative is one or more words
separated by spaces, ``-`` or ``_``. A GPU matches the spec when it matches any
alternative, and it matches an alternative when every word matches.

Matching is by token, case-insensitively. A model name and a word are both cut
into runs of letters and runs of digits ("NVIDIA GeForce RTX 4090" -> NVIDIA,
GEFORCE, RTX, 4090; "Tesla V100-SXM2-16GB" -> TESLA, V, 100, SXM, 2, 16, GB). A
word matches when its runs appear *contiguously* in the model's runs, so

* "RTX 4090", "rtx4090", "4090" and "GeForce 4090" match "NVIDIA GeForce RTX 4090";
* "A100" matches "NVIDIA A100-SXM4-80GB" but "A10" does not (run 10 != 100);
* "V100 16GB" matches "Tesla V100-SXM2-16GB" and not the 32 GB part.

The trace shorthand ``<model>M<GiB>`` ("V100M16", "A100M80") is a model word plus
a memory size: the GPU must match the model word and its total memory must be
within 10 % of that many GiB (NVML reports usable memory, e.g. 16,160 MiB for a
16 GB V100), so it matches whatever the model name says about memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = [
    "ModelPattern",
    "parse_gpu_spec",
    "model_runs",
    "model_codes",
    "coded_spec_mask",
    "gpu_spec_mask",
    "MEMORY_TOLERANCE",
]

# Shorthand "V100M16": a model word with trailing M<GiB>.
# Letters right before the M (V100SXM2) make it a model word, not the shorthand.
_SHORTHAND = re.compile(r"^([A-Z]+[0-9]+)M([0-9]+)$")
_WORD = re.compile(r"[A-Za-z0-9]+")
_RUN = re.compile(r"[A-Z]+|[0-9]+")
# Relative tolerance on the shorthand's memory size (see module docstring).
MEMORY_TOLERANCE = 0.10


@dataclass(frozen=True, slots=True)
class ModelPattern:
    """One alternative of a gpu_spec: words (as runs) and an optional memory size."""

    words: tuple[tuple[str, ...], ...]
    memory_gib: float | None = None


def model_runs(model: str) -> tuple[str, ...]:
    """The letter and digit runs of a model name, upper-cased."""
    return tuple(_RUN.findall(model.upper()))


def parse_gpu_spec(spec: str) -> tuple[ModelPattern, ...]:
    """Parse a gpu_spec; ``()`` for the empty spec (any model).

    Raises ``ValueError`` naming the bad alternative, e.g. for "V100|" (empty
    alternative) or "M16" (shorthand without a model).
    """
    if not spec.strip():
        return ()
    patterns: list[ModelPattern] = []
    for alternative in spec.split("|"):
        words = _WORD.findall(alternative)
        if not words:
            raise ValueError(f"empty alternative in gpu_spec {spec!r}")
        memory: float | None = None
        runs: list[tuple[str, ...]] = []
        for word in words:
            upper = word.upper()
            short = _SHORTHAND.match(upper)
            if short is not None:
                if memory is not None:
                    raise ValueError(f"two memory sizes in alternative {alternative!r}")
                memory = float(short.group(2))
                if memory <= 0:
                    raise ValueError(f"memory size 0 in alternative {alternative!r}")
                upper = short.group(1)
            runs.append(tuple(_RUN.findall(upper)))
        patterns.append(ModelPattern(words=tuple(runs), memory_gib=memory))
    return tuple(patterns)


def _contains(haystack: tuple[str, ...], needle: tuple[str, ...]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


def _name_matches(pattern: ModelPattern, runs: tuple[str, ...]) -> bool:
    return all(_contains(runs, word) for word in pattern.words)


def gpu_spec_mask(
    models: Sequence[str] | np.ndarray,
    memory_total_mib: np.ndarray,
    spec: str | tuple[ModelPattern, ...],
) -> np.ndarray:
    """Bool mask over GPUs: the model (and memory, for the shorthand) matches ``spec``.

    Name matching runs once per distinct model name, memory matching is one
    vector comparison, so the cost does not grow with a Python loop per GPU.
    """
    patterns = parse_gpu_spec(spec) if isinstance(spec, str) else spec
    count = len(models)
    if not patterns:
        return np.ones(count, dtype=bool)
    return coded_spec_mask(model_codes(models), memory_total_mib, patterns)


def model_codes(models: Sequence[str] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct model names, per GPU the index of its name): the slow part of
    ``gpu_spec_mask``, reusable while the models column is."""
    names, codes = np.unique(np.asarray(models, dtype=object).astype(str), return_inverse=True)
    return names, codes.reshape(-1)


def coded_spec_mask(
    coded: tuple[np.ndarray, np.ndarray],
    memory_total_mib: np.ndarray,
    patterns: tuple[ModelPattern, ...],
) -> np.ndarray:
    """``gpu_spec_mask`` over ``model_codes(models)`` and parsed, non-empty patterns."""
    names, codes = coded
    count = codes.shape[0]
    runs = [model_runs(str(name)) for name in names]
    total_gib = np.asarray(memory_total_mib, dtype=np.float64) / 1024.0
    mask = np.zeros(count, dtype=bool)
    for pattern in patterns:
        by_name = np.fromiter((_name_matches(pattern, r) for r in runs), dtype=bool, count=len(runs))
        hit = by_name[codes] if count else np.zeros(0, dtype=bool)
        if pattern.memory_gib is not None:
            # NaN totals compare False: an unknown size does not prove a match.
            hit &= np.abs(total_gib - pattern.memory_gib) <= MEMORY_TOLERANCE * pattern.memory_gib
        mask |= hit
    return mask
