"""The load generator and the 1-to-32 concurrency sweep against the real service (short: zero errors, complete
outputs; speed is reported by `evospec loadtest-sweep`, never asserted)."""
import asyncio
import json

import pytest

from evospec.loadtest.datasets import build_requests, load_prompts
from evospec.loadtest.run import main as loadtest_main
from evospec.loadtest.run import run_load, summarize
from evospec.loadtest.sweep import plot, sweep, table

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def test_sweep_1_to_32_has_no_errors(service, client, tmp_path):
    address = service[0]
    results = sweep(address, ["ar", "evospec"], [1, 4, 32], requests_per_level=1, output_len=8, dataset="medical",
                    seed=0, timeout=300)
    for method, by_level in results.items():
        for level, s in by_level.items():
            assert s["failed"] == 0 and s["errors"] == {}, (method, level, s["errors"])
            assert s["completed"] == max(level, 1) and s["complete_outputs"]
            assert s["total_output_tokens"] > 0
    assert results["evospec"][1]["tau"] > 1.0 and results["ar"][1]["tau"] == 1.0
    assert "| evospec | 32 |" in table(results)
    plot(results, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_open_loop_poisson_with_goodput(service, client, tmp_path):
    rc = loadtest_main(["--server", service[0], "--num-prompts", "6", "--request-rate", "20", "--output-len", "8",
                        "--dataset", "spec-bench", "--method", "frspec", "--goodput", "ttft:60000", "e2el:120000",
                        "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "loadtest.json").read_text())["summary"]
    assert rc == 0 and summary["completed"] == 6 and summary["goodput"] > 0
    assert set(summary["ttft_ms"]) == {"mean", "median", "p90", "p99"}
    assert (tmp_path / "loadtest_cdf.png").exists()


def test_errors_are_counted_by_status(service, client):
    requests = build_requests(load_prompts("medical", 3, 0), 0, None, 0)  # max_tokens 0 is invalid
    results, duration = asyncio.run(run_load(service[0], requests, {}, 2, float("inf"), 1.0, 0, 60, progress=False))
    assert summarize(results, duration)["errors"] == {"INVALID_ARGUMENT": 3}
