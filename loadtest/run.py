"""Async load generator over the client SDK or any OpenAI-compatible endpoint, with `vllm bench serve` conventions.

    evospec loadtest --server 127.0.0.1:9000 --num-prompts 64 --max-concurrency 16
    evospec loadtest --request-rate 4 --burstiness 1.0 --dataset spec-bench --goodput ttft:500 tpot:50
    evospec loadtest --api openai --server http://127.0.0.1:8000 --max-concurrency 8   # the HTTP front (or vLLM)

Both fronts send the same requests: chat completions of --output-len tokens (greedy unless --temperature). With
--api openai the streamed chat completion asks for usage (`stream_options.include_usage`), so output tokens and τ
come from the server's counts, not from counting messages (one message can carry several tokens when speculation
accepts them).

Closed loop: --max-concurrency caps requests in flight. Open loop: --request-rate (req/s, inf = all at once) with
gamma-distributed gaps (burstiness 1 = Poisson). Reports TTFT, TPOT, ITL, E2EL (mean/median/p90/p99), request and
token throughput, goodput for SLOs, τ/α aggregated from per-request stats, and errors by status code.
Latency definitions (vLLM's): TTFT = first streamed tokens; TPOT = (E2EL - TTFT) / (output tokens - 1);
ITL = gaps between streamed messages (one message can carry several tokens when speculation accepts them).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from evospec.datasets import load_prompts
from evospec.loadtest.datasets import LoadRequest, build_requests, write_jsonl
from evospec_client import AsyncEvoSpecClient, EvoSpecClientError


@dataclass
class RequestResult:
    ok: bool
    max_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    finish_reason: str = ""
    error: str = ""
    stats: dict = field(default_factory=dict)
    text: str = ""  # the answer as streamed (scored by `evospec bench humaneval`)

    @property
    def tpot(self) -> float:
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


async def one_request(client: AsyncEvoSpecClient, req: LoadRequest, spec: dict, timeout: float) -> RequestResult:
    start = time.perf_counter()
    last = start
    result = RequestResult(ok=False, max_tokens=req.max_tokens)
    try:
        async for delta in client.stream(messages=req.messages, max_tokens=req.max_tokens, timeout=timeout,
                                         temperature=req.temperature, ignore_eos=req.ignore_eos, **spec):
            now = time.perf_counter()
            if delta.token_ids:
                if result.output_tokens == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                result.output_tokens += len(delta.token_ids)
            result.text += delta.text
            if delta.finish_reason:
                result.finish_reason, result.stats = delta.finish_reason, delta.stats
        result.e2el = time.perf_counter() - start
        result.ok = bool(result.finish_reason)
    except EvoSpecClientError as e:
        result.error = e.code.name
    return result


async def one_openai_request(client, req: LoadRequest, spec: dict, timeout: float, model: str) -> RequestResult:
    """The same request through an OpenAI-compatible endpoint (`openai.AsyncOpenAI`): streamed, with usage; the
    speculation options ride in the body extension `speculation`, ignore_eos in vLLM's extension field."""
    import openai
    start = time.perf_counter()
    last = start
    result = RequestResult(ok=False, max_tokens=req.max_tokens)
    extra = ({"speculation": spec} if spec else {}) | ({"ignore_eos": True} if req.ignore_eos else {})
    try:
        stream = await client.chat.completions.create(
            model=model, messages=req.messages, max_tokens=req.max_tokens, temperature=req.temperature, stream=True,
            stream_options={"include_usage": True}, extra_body=extra or None, timeout=timeout)
        async for chunk in stream:
            now = time.perf_counter()
            choice = chunk.choices[0] if chunk.choices else None
            if choice is not None and choice.delta.content:
                result.text += choice.delta.content
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
            if choice is not None and choice.finish_reason:
                result.finish_reason = choice.finish_reason
            if chunk.usage is not None:
                result.output_tokens = chunk.usage.completion_tokens
                result.stats = (chunk.usage.model_extra or {}).get("speculation") or {}
        result.e2el = time.perf_counter() - start
        result.ok = bool(result.finish_reason)
    except openai.APIStatusError as e:
        result.error = f"HTTP {e.status_code}"
    except (openai.APIConnectionError, openai.APITimeoutError) as e:
        result.error = type(e).__name__
    except openai.APIError as e:  # an error event in the stream, after the 200 status
        result.error = type(e).__name__
    return result


@contextlib.asynccontextmanager
async def open_client(api: str, server: str, timeout: float):
    """(client, request function) for one front: the gRPC SDK, or the `openai` client on `server`/v1 with the first
    model it lists (any OpenAI-compatible server: ours, vLLM, SGLang)."""
    if api == "grpc":
        async with AsyncEvoSpecClient(server, timeout=timeout) as client:
            yield client, one_request
        return
    import openai
    base = server if server.startswith("http") else f"http://{server}"
    async with openai.AsyncOpenAI(base_url=f"{base.rstrip('/')}/v1", api_key=os.environ.get("OPENAI_API_KEY", "none"),
                                  timeout=timeout, max_retries=0) as client:
        model = (await client.models.list()).data[0].id
        yield client, functools.partial(one_openai_request, model=model)


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    if rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return list(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n))


async def run_load(address: str, requests: list[LoadRequest], spec: dict, max_concurrency: int | None,
                   request_rate: float, burstiness: float, seed: int, timeout: float,
                   max_duration_s: float | None = None, progress: bool = True, api: str = "grpc"
                   ) -> tuple[list[RequestResult], float]:
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc="requests", disable=not progress)
    async with open_client(api, address, timeout) as (client, send):
        async def guarded(req):
            if sem is None:
                res = await send(client, req, spec, timeout)
            else:
                async with sem:
                    res = await send(client, req, spec, timeout)
            bar.update(1)
            return res

        start = time.perf_counter()
        tasks = []
        for req, gap in zip(requests, arrival_gaps(len(requests), request_rate, burstiness, seed)):
            if max_duration_s and time.perf_counter() - start > max_duration_s:
                break  # bounded in time: stop issuing, finish what is in flight
            tasks.append(asyncio.create_task(guarded(req)))
            if gap:
                await asyncio.sleep(gap)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def percentiles(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    arr = np.asarray(values) * scale
    return {"mean": round(float(arr.mean()), 3), "median": round(float(np.median(arr)), 3),
            "p90": round(float(np.percentile(arr, 90)), 3), "p99": round(float(np.percentile(arr, 99)), 3)}


def summarize(results: list[RequestResult], duration: float, slos_ms: dict[str, float] | None = None) -> dict:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "INCOMPLETE"] = errors.get(r.error or "INCOMPLETE", 0) + 1
    out_tokens = sum(r.output_tokens for r in ok)
    steps = sum(r.stats.get("steps", 0) for r in ok)
    accepted = sum(r.stats.get("accepted", 0) for r in ok)
    drafted = sum(r.stats.get("drafted", 0) for r in ok)
    summary = {
        "completed": len(ok), "failed": len(results) - len(ok), "errors": errors, "duration_s": round(duration, 3),
        "request_throughput": round(len(ok) / duration, 4), "output_token_throughput": round(out_tokens / duration, 2),
        "total_output_tokens": out_tokens,
        "ttft_ms": percentiles([r.ttft for r in ok]), "tpot_ms": percentiles([r.tpot for r in ok if r.output_tokens > 1]),
        "itl_ms": percentiles([x for r in ok for x in r.itl]), "e2el_ms": percentiles([r.e2el for r in ok]),
        "tau": round(1 + accepted / steps, 4) if steps else 0.0, "alpha": round(accepted / drafted, 4) if drafted else 0.0,
        "complete_outputs": all(r.finish_reason in ("stop", "length") for r in ok),
    }
    if slos_ms:
        good = [r for r in ok if all(getattr(r, k) * 1000 <= v for k, v in slos_ms.items())]
        summary["goodput"] = round(len(good) / duration, 4)
        summary["slos_ms"] = slos_ms
    return summary


def plot_cdfs(results: list[RequestResult], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, (name, values) in zip(axes, [("TTFT (ms)", [r.ttft for r in ok]), ("TPOT (ms)", [r.tpot for r in ok]),
                                         ("E2EL (ms)", [r.e2el for r in ok])]):
        v = np.sort(np.asarray(values) * 1000)
        ax.plot(v, np.arange(1, len(v) + 1) / max(len(v), 1))
        ax.set_xlabel(name)
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    if not items:
        return None
    slos = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput keys are ttft, tpot, e2el (ms); got {key!r}")
        slos[key] = float(value)
    return slos


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--api", choices=["grpc", "openai"], default="grpc",
                    help="grpc: our SDK on Serve's gRPC port; openai: an OpenAI-compatible HTTP endpoint")
    ap.add_argument("--server", help="grpc: HOST:PORT (default 127.0.0.1:9000); openai: base URL (default "
                                     "http://127.0.0.1:8000; $OPENAI_API_KEY is sent as the key)")
    ap.add_argument("--dataset", default="medical", choices=["medical", "spec-bench", "jsonl"])
    ap.add_argument("--dataset-path")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--output-len-range", type=int, nargs=2, metavar=("MIN", "MAX"))
    ap.add_argument("--max-concurrency", type=int)
    ap.add_argument("--request-rate", type=float, default=float("inf"))
    ap.add_argument("--burstiness", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--method", default="")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (OpenAI clients default to 1.0)")
    ap.add_argument("--ignore-eos", action="store_true", help="always generate the full output length")
    ap.add_argument("--write-dataset", type=Path, metavar="JSONL",
                    help="write the requests as JSONL for other load tools (guidellm --data kind=json_file) and exit")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--max-duration", type=float, default=600.0, help="stop issuing requests after this many s")
    ap.add_argument("--goodput", nargs="*", help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:5000")
    ap.add_argument("--out", type=Path, default=Path("results/loadtest"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    args = ap.parse_args(argv)
    args.server = args.server or ("127.0.0.1:9000" if args.api == "grpc" else "http://127.0.0.1:8000")
    requests = build_requests(load_prompts(args.dataset, args.num_prompts, args.seed, args.dataset_path),
                              args.output_len, tuple(args.output_len_range) if args.output_len_range else None,
                              args.seed, args.temperature, args.ignore_eos)
    if args.write_dataset:
        write_jsonl(requests, args.write_dataset)
        print(f"wrote {len(requests)} requests to {args.write_dataset}")
        return 0
    spec = {"method": args.method} if args.method else {}
    results, duration = asyncio.run(run_load(args.server, requests, spec, args.max_concurrency, args.request_rate,
                                             args.burstiness, args.seed, args.timeout, args.max_duration,
                                             api=args.api))
    summary = summarize(results, duration, parse_goodput(args.goodput))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "loadtest.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                        "summary": summary,
                                                        "requests": [asdict(r) for r in results]}, indent=1))
    plot_cdfs(results, args.out / "loadtest_cdf.png",
              f"{args.method or 'default'} method, {args.dataset}, {args.api} front")
    print(json.dumps(summary, indent=1))
    return 0 if summary["failed"] == 0 else 1
