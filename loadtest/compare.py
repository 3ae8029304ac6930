"""One table from the same load driven by guidellm and by our load test (either front).

    evospec loadtest-compare results/loadtest_tools

Reads <dir>/guidellm/benchmarks.json (guidellm 0.8's output) and <dir>/ours-*/loadtest.json, and writes
<dir>/compare.md: output tok/s, request/s, TTFT, ITL, TPOT and E2EL as each tool measured them. The tools define
ITL differently: guidellm spreads a request's decode time over its output tokens ((last - first token time) /
(tokens - 1), i.e. our TPOT), while our ITL is the gap between streamed messages, which under speculation carry
several tokens each.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def guidellm_row(path: Path) -> dict:
    bench = json.loads(path.read_text())["benchmarks"][0]
    m = bench["metrics"]

    def stat(key: str, name: str, scale: float = 1.0) -> float:
        return round(m[key]["successful"][name] * scale, 2)
    totals = m["request_totals"]
    return {"tool": "guidellm 0.8.1 (HTTP)", "completed": totals["successful"],
            "failed": totals["errored"] + totals["incomplete"],
            "output_tok_s": stat("output_tokens_per_second", "mean"), "req_s": stat("requests_per_second", "mean", 1),
            "ttft_ms_median": stat("time_to_first_token_ms", "median"),
            "ttft_ms_p99": round(m["time_to_first_token_ms"]["successful"]["percentiles"]["p99"], 2),
            "tpot_ms_median": stat("time_per_output_token_ms", "median"),
            "itl_ms_median": stat("inter_token_latency_ms", "median"),
            "e2el_ms_median": stat("request_latency", "median", 1000.0),
            "output_tokens_mean": stat("output_token_count", "mean")}


def ours_row(path: Path) -> dict:
    data = json.loads(path.read_text())
    s, api = data["summary"], data["args"].get("api", "grpc")
    return {"tool": f"evospec loadtest --api {api}", "completed": s["completed"], "failed": s["failed"],
            "output_tok_s": s["output_token_throughput"], "req_s": round(s["request_throughput"], 3),
            "ttft_ms_median": s["ttft_ms"]["median"], "ttft_ms_p99": s["ttft_ms"]["p99"],
            "tpot_ms_median": s["tpot_ms"]["median"], "itl_ms_median": s["itl_ms"]["median"],
            "e2el_ms_median": s["e2el_ms"]["median"],
            "output_tokens_mean": round(s["total_output_tokens"] / max(s["completed"], 1), 2)}


COLUMNS = ["tool", "completed", "failed", "output_tok_s", "req_s", "ttft_ms_median", "ttft_ms_p99", "tpot_ms_median",
           "itl_ms_median", "e2el_ms_median", "output_tokens_mean"]


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    args = ap.parse_args(argv)
    rows = []
    if (args.dir / "guidellm" / "benchmarks.json").exists():
        rows.append(guidellm_row(args.dir / "guidellm" / "benchmarks.json"))
    rows += [ours_row(p) for p in sorted(args.dir.glob("ours-*/loadtest.json"))]
    if not rows:
        raise SystemExit(f"no results under {args.dir} (guidellm/benchmarks.json, ours-*/loadtest.json)")
    text = table(rows)
    (args.dir / "compare.md").write_text(text + "\n")
    print(text)
    return 0
