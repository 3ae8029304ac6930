"""What the OpenAI-compatible HTTP front costs against the gRPC front, side by side on one service.

    evospec bench fronts [--pair tiny|qwen2.5-coder] [--repeats 5] [--prompts 3] [--max-tokens 64] [--method evospec]

One local service (the pair's CPU config; Ray Serve with both proxies). Each request is a greedy streamed chat of
exactly --max-tokens tokens (ignore_eos), sent through the gRPC SDK and through the `openai` client on the HTTP port,
one at a time, the two fronts back to back in alternating order (drift hits both alike); repeat 0 warms up and is
not recorded. Latency is measured by the client: end to end (request sent -> last chunk) and TTFT. Prints HTTP ÷ gRPC
for each pair of requests (min / median / max) and the greedy texts' agreement. Writes
results/bench_fronts/bench_fronts.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from evospec.bench.harness import summarize as min_median_max
from evospec.bench.prompts import PROMPT_SETS
from evospec.config import METHODS
from evospec.modelstore.catalog import pair_names

FRONTS = ("grpc", "http")


def timed_grpc(client, messages: list[dict], max_tokens: int, method: str) -> dict:
    start, first, text = time.perf_counter(), None, []
    for delta in client.stream(messages=messages, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                               method=method):
        if first is None and delta.token_ids:
            first = time.perf_counter()
        text.append(delta.text)
        last = delta
    end = time.perf_counter()
    return {"e2e_s": end - start, "ttft_s": first - start, "text": "".join(text),
            "tokens": last.stats["generated_tokens"]}


def timed_http(client, model: str, messages: list[dict], max_tokens: int, method: str) -> dict:
    start, first, text, usage = time.perf_counter(), None, [], None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True, "speculation": {"method": method}})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    end = time.perf_counter()
    return {"e2e_s": end - start, "ttft_s": first - start, "text": "".join(text), "tokens": usage.completion_tokens}


def summarize(pairs: list[dict]) -> dict:
    e2e = [p["http"]["e2e_s"] / p["grpc"]["e2e_s"] for p in pairs]
    ttft = [p["http"]["ttft_s"] / p["grpc"]["ttft_s"] for p in pairs]
    return {"pairs": len(pairs), "http_over_grpc_e2e": min_median_max(e2e), "http_over_grpc_ttft": min_median_max(ttft),
            "grpc_e2e_s": min_median_max([p["grpc"]["e2e_s"] for p in pairs]),
            "http_e2e_s": min_median_max([p["http"]["e2e_s"] for p in pairs]),
            "http_added_ms_median": round(1000 * statistics.median(
                p["http"]["e2e_s"] - p["grpc"]["e2e_s"] for p in pairs), 2),
            "same_text": sum(p["http"]["text"] == p["grpc"]["text"] for p in pairs),
            "same_tokens": sum(p["http"]["tokens"] == p["grpc"]["tokens"] for p in pairs)}


def table(summary: dict, args) -> str:
    e, t = summary["http_over_grpc_e2e"], summary["http_over_grpc_ttft"]
    return "\n".join([
        f"pair {args.pair}, method {args.method}, {args.max_tokens} tokens, greedy, concurrency 1, "
        f"{summary['pairs']} request pairs",
        "", "| | min | median | max |", "|---|---|---|---|",
        f"| HTTP ÷ gRPC, end to end | {e['min']:.3f} | {e['median']:.3f} | {e['max']:.3f} |",
        f"| HTTP ÷ gRPC, TTFT | {t['min']:.3f} | {t['median']:.3f} | {t['max']:.3f} |",
        f"| gRPC end to end (s) | {summary['grpc_e2e_s']['min']:.3f} | {summary['grpc_e2e_s']['median']:.3f} | "
        f"{summary['grpc_e2e_s']['max']:.3f} |",
        f"| HTTP end to end (s) | {summary['http_e2e_s']['min']:.3f} | {summary['http_e2e_s']['median']:.3f} | "
        f"{summary['http_e2e_s']['max']:.3f} |",
        "", f"HTTP adds {summary['http_added_ms_median']} ms (median of pairs); identical greedy text in "
            f"{summary['same_text']}/{summary['pairs']} pairs, identical token counts in "
            f"{summary['same_tokens']}/{summary['pairs']}."])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="tiny", choices=pair_names())
    ap.add_argument("--config", help="service config (default orchestration/configs/cpu-<pair>.yaml)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--method", default="evospec", choices=METHODS)
    ap.add_argument("--out", type=Path, default=Path("results/bench_fronts"))
    args = ap.parse_args(argv)
    import openai

    from evospec.orchestration.config import AppConfig, config_for_pair
    from evospec.orchestration.local import free_port, local_service
    from evospec_client import EvoSpecClient

    cfg = AppConfig.from_yaml(args.config or config_for_pair(args.pair)).model_copy(
        update={"grpc_port": 0, "http_port": free_port()})
    convs = PROMPT_SETS["medical"](args.prompts)
    pairs = []
    with local_service(cfg) as address, EvoSpecClient(address, timeout=600) as grpc_client, \
            openai.OpenAI(base_url=f"http://127.0.0.1:{cfg.http_port}/v1", api_key="none", timeout=600,
                          max_retries=0) as http_client:
        grpc_client.wait_ready()
        model = http_client.models.list().data[0].id
        for rep in range(args.repeats + 1):  # repeat 0 warms both paths up and is not recorded
            for i, messages in enumerate(convs):
                order = FRONTS if (rep + i) % 2 == 0 else FRONTS[::-1]
                row = {}
                for front in order:
                    row[front] = (timed_grpc(grpc_client, messages, args.max_tokens, args.method) if front == "grpc"
                                  else timed_http(http_client, model, messages, args.max_tokens, args.method))
                if rep:
                    pairs.append({"repeat": rep, "prompt": i, "first": order[0], **row})
                    print(f"rep {rep} prompt {i}: gRPC {row['grpc']['e2e_s']:.3f} s, HTTP {row['http']['e2e_s']:.3f} s "
                          f"(÷ {row['http']['e2e_s'] / row['grpc']['e2e_s']:.3f})", flush=True)
    summary = summarize(pairs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_fronts.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                            "summary": summary, "pairs": pairs}, indent=1))
    (args.out / "bench_fronts.md").write_text(table(summary, args) + "\n")
    print(table(summary, args))
