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


def decode_tokens_per_second(stats: dict) -> float:
    """Tokens after the first over the time after the first (what a reader of the stream sees once it started)."""
    tokens, decode_s = stats.get("generated_tokens", 0), stats.get("e2e_seconds", 0) - stats.get("ttft_seconds", 0)
    return (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else 0.0


def comparison_table(runs: dict[str, dict]) -> Table:
    """The same prompt through the same service, one row per method: TTFT, tok/s end to end and after the first
    token, τ, and the ratio of end-to-end tok/s to the first row's (plain decoding)."""
    table = Table(title="the same prompt, the same service", show_header=True)
    for column in ("method", "TTFT s", "tok/s (end to end)", "tok/s (after 1st token)", "τ", "mean depth",
                   "× first row"):
        table.add_column(column, justify="left" if column == "method" else "right")
    base = None
    for method, stats in runs.items():
        e2e = stats.get("generated_tokens", 0) / max(stats.get("e2e_seconds", 0), 1e-9)
        base = e2e if base is None else base
        steps = stats.get("steps", 0)
        depth = stats.get("drafted_levels", 0) / steps if steps else 0.0
        table.add_row(method, f"{stats.get('ttft_seconds', 0):.2f}", f"{e2e:.2f}",
                      f"{decode_tokens_per_second(stats):.2f}", f"{stats.get('tau', 0):.2f}", f"{depth:.2f}",
                      f"{e2e / base:.2f}" if base else "-")
    return table


def print_comparison(runs: dict[str, dict]) -> None:
    Console().print(comparison_table(runs))
