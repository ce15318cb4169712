"""Small text and HTML helpers shared by the objects that show themselves in a terminal or a notebook.

This module imports nothing from the package, so any module (config, delta, modeling) may use it
without creating an import cycle.
"""

from __future__ import annotations

import html
import numbers
from typing import Iterable, Mapping, Optional, Sequence

_UNITS = ("B", "kB", "MB", "GB", "TB")


def format_bytes(n: Optional[float]) -> str:
    """``1234567`` -> ``"1.2 MB"`` (powers of 1000, as file sizes are usually shown); ``None`` -> ``"?"``."""
    if n is None:
        return "?"
    n = float(n)
    for unit in _UNITS:
        if abs(n) < 1000 or unit == _UNITS[-1]:
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def format_ratio(ratio: Optional[float]) -> str:
    return "?" if ratio is None else f"{ratio:.2f}x"


def _cell(value) -> str:
    if isinstance(value, float):
        text = f"{value:.4g}"
    elif value is None:
        text = "-"
    else:
        text = str(value)
    numeric = isinstance(value, numbers.Number) and not isinstance(value, bool)
    style = ' style="text-align:right"' if numeric else ""
    return f"<td{style}>{html.escape(text)}</td>"


def delta_table_html(
    rows: Iterable[Mapping | Sequence],
    columns: Optional[Sequence[str]] = None,
    caption: Optional[str] = None,
) -> str:
    """An HTML ``<table>`` of ``rows`` (dicts, or sequences in the order of ``columns``).

    Columns default to the keys of the first dict row; cells are escaped, numbers right-aligned,
    floats shown with 4 significant digits and ``None`` as ``-``. Used by the ``_repr_html_`` of
    :class:`~hf_deltazip.DeltaZipConfig`, :class:`~hf_deltazip.CompressedDelta` and
    :class:`~hf_deltazip.delta.PackedModule`, and meant for any other object that lists deltas.

    Example:
        >>> delta_table_html([{"delta": "a", "bits": 4}], caption="loaded deltas")
        '<table><caption>loaded deltas</caption><thead><tr><th>delta</th><th>bits</th></tr></thead><tbody><tr><td>a</td><td style="text-align:right">4</td></tr></tbody></table>'
    """
    rows = list(rows)
    if columns is None:
        columns = list(rows[0]) if rows and isinstance(rows[0], Mapping) else []
    out = ["<table>"]
    if caption:
        out.append(f"<caption>{html.escape(caption)}</caption>")
    if columns:
        out.append("<thead><tr>" + "".join(f"<th>{html.escape(str(c))}</th>" for c in columns) + "</tr></thead>")
    out.append("<tbody>")
    for row in rows:
        cells = [row.get(c) for c in columns] if isinstance(row, Mapping) else list(row)
        out.append("<tr>" + "".join(_cell(v) for v in cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def html_section(title: str, *parts: str) -> str:
    """A titled block of HTML parts (tables, paragraphs), as one notebook output."""
    return f"<div><strong>{html.escape(title)}</strong>" + "".join(parts) + "</div>"
