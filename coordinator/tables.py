"""Plain-text tables for terminals: what the CLI, the demo and the benchmarks
print for people."""

from __future__ import annotations

from typing import Sequence

__all__ = ["render_table", "fmt", "safe_text"]


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


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, align: str | None = None) -> str:
    """Columns padded to their widest cell; numbers right-aligned.

    ``align`` is one character per column ('l' or 'r'); by default a column is
    right-aligned when every non-empty cell in it looks numeric.
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

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(row, widths, align)).rstrip()

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out.extend(line(r) for r in cells)
    return "\n".join(out)
