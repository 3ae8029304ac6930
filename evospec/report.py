"""Human-readable rendering of speculative-decoding statistics (shared by the demo, the CLI and the SDK examples)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table


def stats_table(stats: dict, title: str = "speculative decoding") -> Table:
    table = Table(title=title, show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [("method", stats.get("method", "")), ("generated tokens", stats.get("generated_tokens")),
            ("steps (target forwards)", stats.get("steps")), ("drafted tokens", stats.get("drafted")),
            ("accepted tokens", stats.get("accepted")), ("τ (tokens / step)", stats.get("tau")),
            ("α (accepted / drafted)", stats.get("alpha")), ("accepted per position", stats.get("accepted_per_pos")),
            ("miss rate (target ∉ A)", stats.get("miss_rate")), ("buffer updates", stats.get("buffer_updates")),
            ("draft seconds", stats.get("draft_seconds")), ("verify seconds", stats.get("verify_seconds")),
            ("tokens / s", stats.get("tokens_per_second"))]
    for name, value in rows:
        if value is not None and value != "":
            table.add_row(name, str(value))
    return table


def print_stats(stats: dict, title: str = "speculative decoding") -> None:
    Console().print(stats_table(stats, title))
