"""The load generator and the 1-to-32 concurrency sweep against the real service (short: zero errors, complete
outputs; speed is reported by `evospec loadtest-sweep`, never asserted)."""
import asyncio
import json

import pytest

from evospec.datasets import load_prompts
from evospec.loadtest.datasets import build_requests
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


def test_openai_mode_drives_the_http_front_with_the_same_results(service, client):
    """The same greedy load through both fronts: the same outputs (token counts, finish reasons, τ per request)."""
    requests = build_requests(load_prompts("medical", 4, 0), 16, None, 0)
    http = f"http://127.0.0.1:{service[1].http_port}"
    runs = {api: asyncio.run(run_load(address, requests, {"method": "evospec"}, 2, float("inf"), 1.0, 0, 120,
                                      progress=False, api=api))[0]
            for api, address in (("grpc", service[0]), ("openai", http))}
    for api, results in runs.items():
        assert all(r.ok for r in results), (api, [r.error for r in results])
    assert [r.output_tokens for r in runs["grpc"]] == [r.output_tokens for r in runs["openai"]]
    assert [r.finish_reason for r in runs["grpc"]] == [r.finish_reason for r in runs["openai"]]
    assert [r.stats["steps"] for r in runs["grpc"]] == [r.stats["steps"] for r in runs["openai"]]
    errors = asyncio.run(run_load(http, build_requests(load_prompts("medical", 2, 0), 0, None, 0), {}, 2,
                                  float("inf"), 1.0, 0, 60, progress=False, api="openai"))
    assert summarize(*errors)["errors"] == {"HTTP 400": 2}
