"""The glue between our load test and guidellm: the same requests written for guidellm, and one table read back
from both tools' output files."""
import json

from evospec.loadtest.compare import guidellm_row, main, ours_row
from evospec.loadtest.datasets import LoadRequest, build_requests, write_jsonl


def test_write_jsonl_keeps_prompts_and_lengths(tmp_path):
    requests = build_requests([[{"role": "user", "content": "q1"}], [{"role": "user", "content": "q2"}]], 64, None,
                              0, temperature=1.0, ignore_eos=True)
    requests.append(LoadRequest([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], 8))
    write_jsonl(requests, tmp_path / "r.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert rows[:2] == [{"prompt": "q1", "output_tokens_count": 64}, {"prompt": "q2", "output_tokens_count": 64}]
    assert rows[2]["messages"][1] == {"role": "assistant", "content": "b"} and rows[2]["output_tokens_count"] == 8
    assert requests[0].temperature == 1.0 and requests[0].ignore_eos


def stat(mean, median=None, p99=None):
    return {"successful": {"mean": mean, "median": mean if median is None else median,
                           "percentiles": {"p99": p99 or mean}}}


def test_compare_reads_guidellm_and_ours_into_one_table(tmp_path):
    metrics = {"request_totals": {"successful": 16, "errored": 1, "incomplete": 0, "total": 17},
               "output_tokens_per_second": stat(12.5), "requests_per_second": stat(0.2),
               "time_to_first_token_ms": stat(300.0, 250.0, 900.0), "time_per_output_token_ms": stat(80.0),
               "inter_token_latency_ms": stat(81.0), "request_latency": stat(5.5, 5.25),
               "output_token_count": stat(64.0)}
    (tmp_path / "guidellm").mkdir()
    (tmp_path / "guidellm" / "benchmarks.json").write_text(json.dumps({"benchmarks": [{"metrics": metrics}]}))
    pct = {"mean": 1.0, "median": 2.0, "p90": 3.0, "p99": 4.0}
    summary = {"completed": 16, "failed": 0, "output_token_throughput": 13.0, "request_throughput": 0.21,
               "ttft_ms": pct, "tpot_ms": pct, "itl_ms": pct, "e2el_ms": pct, "total_output_tokens": 1024}
    (tmp_path / "ours-openai").mkdir()
    (tmp_path / "ours-openai" / "loadtest.json").write_text(json.dumps({"args": {"api": "openai"},
                                                                         "summary": summary}))
    g = guidellm_row(tmp_path / "guidellm" / "benchmarks.json")
    assert g["failed"] == 1 and g["ttft_ms_median"] == 250.0 and g["ttft_ms_p99"] == 900.0
    assert g["e2el_ms_median"] == 5250.0
    o = ours_row(tmp_path / "ours-openai" / "loadtest.json")
    assert o["tool"].endswith("--api openai") and o["output_tokens_mean"] == 64.0
    assert main([str(tmp_path)]) == 0
    lines = (tmp_path / "compare.md").read_text().splitlines()
    assert len(lines) == 4 and lines[2].startswith("| guidellm") and "| 13.0 |" in lines[3]
