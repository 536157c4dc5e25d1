"""Print a titled table: through rich when it is installed (Lightning's rich progress bar brings it), as
aligned plain text otherwise, so reports look the same in logs, terminals and notebooks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO


def format_plain(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in columns], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    line = "  ".join("-" * w for w in widths)
    out = [title, line, "  ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True)), line]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells[1:]]
    return "\n".join(out)


def print_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[object]],
    file: TextIO | None = None,
    width: int | None = None,
) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_plain(title, columns, rows), file=file)
        return
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(c) for c in row))
    Console(file=file, width=width).print(table)
