"""Tables that fit the terminal without cutting a figure: a row's name and every cell keep their
width (headers wrap at their spaces instead), and at a narrow terminal the optional columns are left
out, named in a note, for `--wide` (every column, whatever the width) or `--json` to show."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Col:
    header: str
    essential: bool = True  # kept at any width; the others go first, rightmost first


def needed_width(cols: list[Col], rows: list[list[str]]) -> int:
    """Characters a rich table of these columns needs with no cell cut: each column as wide as its
    widest cell or header word, plus rich's borders and padding (3 per column, 1 more)."""
    widths = [max([len(r[i]) for r in rows] + [len(w) for w in c.header.split()]) for i, c in enumerate(cols)]
    return sum(widths) + 3 * len(cols) + 1


def fit_columns(cols: list[Col], rows: list[list[str]], width: int, wide: bool) -> list[int]:
    """Indexes of the columns shown: all with --wide, else the optional ones dropped, rightmost first,
    until the table fits WIDTH (the essential ones stay even when it still does not)."""
    keep = list(range(len(cols)))
    optional = [i for i in keep if not cols[i].essential]
    while not wide and optional and needed_width([cols[i] for i in keep], [[r[i] for i in keep] for r in rows]) > width:
        keep.remove(optional.pop())
    return keep


def fitted_table(title: str, cols: list[Col], rows: list[list[str]], width: int, wide: bool):
    """(the rich Table, the headers left out). The first column is the row's name, never wrapped."""
    from rich.table import Table

    keep = fit_columns(cols, rows, width, wide)
    table = Table(title=title)
    for n, i in enumerate(keep):
        widest = max([len(r[i]) for r in rows] + [len(w) for w in cols[i].header.split()])
        table.add_column(cols[i].header, justify="left" if n == 0 else "right", min_width=widest, no_wrap=n == 0)
    for r in rows:
        table.add_row(*(r[i] for i in keep))
    return table, [cols[i].header for i in range(len(cols)) if i not in keep]


def print_fitted(console, table, dropped: list[str], wide: bool) -> None:
    """--wide prints at the width the table needs (a wider virtual console), never squeezing a cell."""
    from moekit.commands.bench_view import print_wide_or_fitted

    print_wide_or_fitted(console, table, wide)
    if dropped:
        console.print(f"left out at this width: {', '.join(dropped)} (--wide or --json shows them)")
