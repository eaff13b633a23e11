"""Plain-text tables for terminals: what the CLI, the demo and the benchmarks
print for people."""

from __future__ import annotations

import os
import sys
import textwrap
from typing import Sequence

__all__ = ["render_table", "fmt", "safe_text", "terminal_width", "wrap", "MIN_CUT"]


def safe_text(text: str) -> str:
    """``text`` with every character a terminal would act on written as its
    escape (``\\x1b``, ``\\n``, ``\\u202e``): control characters, line breaks,
    bidi overrides and other format characters. What an agent reports (a GPU
    model, a label, a driver string) and what a tenant writes (a cancel
    reason) reach an operator's terminal through these tables: raw, an ESC
    sequence set the window title or cleared the screen, and a newline added
    fake rows."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def fmt(value, digits: int = 1, unit: str = "") -> str:
    """A number for a table cell; '-' for absent."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        text = f"{value:,.{digits}f}"
    else:
        text = f"{value:,}" if isinstance(value, int) else str(value)
    return f"{text}{unit}"


#: a cut column keeps at least this many characters (or its header's), "…" included
MIN_CUT = 8

def terminal_width(stream=None) -> int | None:
    """Columns a table written to ``stream`` (default stdout) may take when
    the stream is a terminal: ``$COLUMNS`` when it holds a positive integer
    (as ``shutil.get_terminal_size``), else the terminal's width. None (no
    limit) for a pipe or a file, whatever ``$COLUMNS`` says: what a script
    reads is never cut (a leaked COLUMNS=80 is common in non-interactive
    environments)."""
    stream = sys.stdout if stream is None else stream
    try:
        if stream is None or not stream.isatty():
            return None
        columns = os.environ.get("COLUMNS", "").strip()
        if columns.isdigit() and int(columns) > 0:
            return int(columns)
        return os.get_terminal_size(stream.fileno()).columns or None
    except (AttributeError, OSError, ValueError):
        return None


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def render_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    align: str | None = None,
    width: int | None = None,
    give_way: Sequence[tuple] = (),
    left_out: list[str] | None = None,
) -> str:
    """Columns padded to their widest cell; numbers right-aligned.

    ``align`` is one character per column ('l' or 'r'); by default a column is
    right-aligned when every non-empty cell in it looks numeric.

    ``width``: the most columns a line may take (``terminal_width()``; None:
    no limit). A wider table gives way step by step, in ``give_way``'s order,
    until it fits: ``(header, "cut")`` shortens that column's cells with "…"
    (down to ``MIN_CUT`` characters or its header's width, or to the third
    item's width when given), ``(header, "drop")`` leaves the column out. A
    table still too wide after every step has its lines cut at ``width``, so
    it never wraps (``gpulb top`` redraws in place). The headers of columns
    left out or cut are appended to ``left_out`` when given (for a "--wide
    shows them" note).
    """
    cells = [[safe_text(str(c)) for c in row] for row in rows]
    headers = [safe_text(str(h)) for h in headers]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    if align is None:
        def numeric(text: str) -> bool:
            stripped = text.replace(",", "").replace(".", "").replace("%", "").replace("-", "").replace("+", "").strip()
            return stripped.isdigit() or text.strip() == "-"
        align = "".join(
            "r" if cells and all(numeric(r[i]) for r in cells) else "l" for i in range(len(headers))
        )
    keep = list(range(len(headers)))
    if width is not None:
        natural = list(widths)
        cut: list[int] = []  # columns shortened, in the order they were
        gave: list[int] = []  # columns cut or left out

        def total() -> int:
            return sum(widths[i] for i in keep) + 2 * max(0, len(keep) - 1)

        for step in give_way:
            if total() <= width:
                break
            header, how = step[0], step[1]
            i = headers.index(header) if header in headers else -1
            if i not in keep:
                continue
            if how == "drop":
                keep.remove(i)
            else:
                narrowest = max(step[2] if len(step) > 2 else MIN_CUT, len(header), 1)
                target = max(narrowest, widths[i] - (total() - width))
                if target >= widths[i]:
                    continue
                widths[i] = target
                if i not in cut:
                    cut.append(i)
            if i not in gave:
                gave.append(i)
        # a column cut before a later one was dropped takes back the room left
        for i in reversed(cut):
            if i in keep and total() < width:
                widths[i] = min(natural[i], widths[i] + width - total())
        cells = [[_cut(c, widths[j]) if j in cut else c for j, c in enumerate(row)] for row in cells]
        if left_out is not None:  # a cut column that took all its room back is whole
            left_out.extend(headers[i] for i in gave if i not in keep or widths[i] < natural[i])

    def line(row: Sequence[str]) -> str:
        text = "  ".join(
            row[i].rjust(widths[i]) if i < len(align) and align[i] == "r" else row[i].ljust(widths[i])
            for i in keep if i < len(row)
        ).rstrip()
        return text if width is None else _cut(text, width)

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def wrap(text: str, width: int | None, *, indent: str = "") -> str:
    """``text`` wrapped at ``width`` columns (None: as it is), later lines
    indented by ``indent``: a long sentence (the advisor's trigger) for a
    terminal."""
    if width is None or len(text) <= width:
        return text
    return textwrap.fill(text, width=max(20, width), subsequent_indent=indent, break_on_hyphens=False)
