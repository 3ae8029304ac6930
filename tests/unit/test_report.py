"""The demo's side-by-side table: what each method got on the same prompt through the same service."""
from rich.console import Console

from evospec.orchestration.report import comparison_table, decode_tokens_per_second


def render(table) -> str:
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def test_comparison_rows_carry_ttft_speed_tau_depth_and_the_ratio_to_plain_decoding():
    ar = {"generated_tokens": 33, "e2e_seconds": 22.0, "ttft_seconds": 6.0, "tau": 1.0, "steps": 33,
          "drafted_levels": 0}
    spec = {"generated_tokens": 33, "e2e_seconds": 11.0, "ttft_seconds": 6.6, "tau": 2.75, "steps": 12,
            "drafted_levels": 36}
    text = render(comparison_table({"ar": ar, "evospec": spec}))
    ar_row = next(line for line in text.splitlines() if line.strip("│ ").startswith("ar"))
    spec_row = next(line for line in text.splitlines() if "evospec" in line)
    assert [c.strip() for c in spec_row.strip("│").split("│")] == ["evospec", "6.60", "3.00", "7.27", "2.75", "3.00",
                                                                    "2.00"]
    assert ar_row.rstrip(" │").endswith("1.00")
    assert decode_tokens_per_second(ar) == 2.0 and decode_tokens_per_second({"generated_tokens": 1}) == 0.0
