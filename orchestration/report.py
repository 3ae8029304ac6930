"""Human-readable rendering of speculative-decoding statistics (the demo and `evospec generate`).

Rows are the statistics as they come (the fields of evospec.v1.SpecStats, in the proto's order, plus whatever the
caller adds such as tokens_per_second); nothing here lists them again.
"""
from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(_format(v) for v in value) + "]"
    return str(value)


def stats_table(stats: dict, title: str = "speculative decoding") -> Table:
    table = Table(title=title, show_header=True)
    table.add_column("statistic")
    table.add_column("value", justify="right")
    for name, value in stats.items():
        if value is not None and value != "":
            table.add_row(name, _format(value))
    return table


def print_stats(stats: dict, title: str = "speculative decoding") -> None:
    Console().print(stats_table(stats, title))
