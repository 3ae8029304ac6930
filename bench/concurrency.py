"""Throughput under load: the batching scheduler vs the per-request loop, at growing concurrency, in one run.

    evospec bench concurrency [--pair tiny|qwen2.5-coder] [--concurrency 1 2 4 8 16 32] [--methods ar sd ...]
                              [--max-tokens 48] [--requests 2] [--modes loop batched] [--out results/bench_concurrency]

Modes (same models, same prompts, interleaved per concurrency level):
- `loop`: the engine before batching, one thread per generation each running `SpeculativeDecoder.generate`;
- `batched`: the continuous-batching `Scheduler` (adaptive draft depth), one thread stepping every generation;
- `fixed`: the scheduler with each request's full tree every step (no adaptation), to show what adapting buys;
- `service`: the decoupled service (Ray Serve + gRPC, draft and target replicas, orchestration/configs/cpu-<pair>
  .yaml) driven through the SDK by the load generator (evospec loadtest), batched the same way.
At concurrency c, `requests * c` medical prompts (at least 4) go through a closed loop that keeps c in flight.
Reported per cell: aggregate tok/s, TTFT and TPOT p50/p99, τ, the scheduler's mean draft depth, and memory: peak RSS
of this process (in-process modes, cumulative over the run) or RSS of each service replica after the cell.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import queue
import resource
import threading
import time
from collections import Counter
from pathlib import Path

from evospec.bench.prompts import PROMPT_SETS
from evospec.config import METHODS, SamplingParams, SchedulerConfig, SpecParams
from evospec.engine.generate import SpeculativeDecoder
from evospec.engine.runner import SchedulerThread
from evospec.engine.scheduler import Failed, Finished, Scheduler, TokensOut
from evospec.engine.stats import SpecStats
from evospec.loading import apply_torch_threads, load_pair
from evospec.modelstore.catalog import pair_names
from evospec.tokenizer import chat_prompt_ids

MODES = ("loop", "batched", "fixed", "service")


class RequestTrace:
    """Timestamps of one request's token events (TTFT, TPOT) and its final statistics."""

    def __init__(self):
        self.start = time.perf_counter()
        self.token_times: list[tuple[float, int]] = []
        self.stats: SpecStats | None = None
        self.tokens: list[int] = []
        self.error: BaseException | None = None

    def tokens_out(self, ids: list[int]) -> None:
        self.token_times.append((time.perf_counter(), len(ids)))
        self.tokens.extend(ids)

    @property
    def ttft(self) -> float:
        return self.token_times[0][0] - self.start if self.token_times else float("nan")

    @property
    def tpot(self) -> float:
        n = sum(k for _, k in self.token_times)
        if n < 2:
            return float("nan")
        return (self.token_times[-1][0] - self.token_times[0][0]) / (n - self.token_times[0][1])


def run_loop(decoder: SpeculativeDecoder, prompts, sampling, spec, concurrency: int) -> list[RequestTrace]:
    """One thread per in-flight generation, each running the per-request loop (the engine before batching)."""
    jobs: queue.Queue = queue.Queue()
    for p in prompts:
        jobs.put(p)
    traces: list[RequestTrace] = []

    def worker():
        while True:
            try:
                prompt = jobs.get_nowait()
            except queue.Empty:
                return
            trace = RequestTrace()
            gen = decoder.generate(prompt, sampling, spec)
            for chunk in gen:
                trace.tokens_out(chunk.token_ids)
            trace.stats = gen.stats
            traces.append(trace)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return traces


def run_scheduler(scheduler: Scheduler, prompts, sampling, spec, concurrency: int) -> list[RequestTrace]:
    """A closed loop through the scheduler's thread: at most `concurrency` requests in flight."""
    slots = threading.Semaphore(concurrency)
    traces: list[RequestTrace] = []
    all_done = threading.Event()
    remaining = [len(prompts)]
    lock = threading.Lock()

    def sink_for(trace: RequestTrace):
        def sink(event):
            if isinstance(event, TokensOut):
                trace.tokens_out(event.token_ids)
                return
            if isinstance(event, Finished):
                trace.stats = event.stats
            elif isinstance(event, Failed):
                trace.error = event.error
            slots.release()
            with lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    all_done.set()
        return sink

    for prompt in prompts:
        slots.acquire()
        trace = RequestTrace()
        traces.append(trace)
        scheduler.submit(prompt, sampling, spec, sink_for(trace))
    all_done.wait()
    errors = [t.error for t in traces if t.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]!r}")
    return traces


def run_service(address: str, convs: list[list[dict]], method: str, max_tokens: int, concurrency: int) -> dict:
    """The same closed loop against the decoupled service; returns this module's row fields."""
    import asyncio

    from evospec.loadtest.datasets import LoadRequest
    from evospec.loadtest.run import run_load
    from evospec.loadtest.run import summarize as load_summary
    requests = [LoadRequest(messages=c, max_tokens=max_tokens) for c in convs]
    results, wall = asyncio.run(run_load(address, requests, {"method": method, "ignore_eos": True, "seed": 0},
                                         concurrency, float("inf"), 1.0, 0, timeout=600, progress=False))
    s = load_summary(results, wall)
    if s["failed"]:
        raise RuntimeError(f"{s['failed']} service requests failed: {s['errors']}")
    return {"tokens_per_s": s["output_token_throughput"], "requests": s["completed"], "tokens": s["total_output_tokens"],
            "ttft_p50_ms": s["ttft_ms"]["median"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "tpot_p50_ms": s["tpot_ms"]["median"], "tpot_p99_ms": s["tpot_ms"]["p99"], "tau": s["tau"]}


def service_rss_mb() -> dict[str, float]:
    """Resident memory of this application's Ray Serve replicas, by deployment: the largest replica of each."""
    from evospec.orchestration.local import replica_processes
    out: dict[str, float] = {}
    for role, procs in replica_processes("evospec").items():
        sizes = []
        for proc in procs:
            with contextlib.suppress(Exception):  # a replica that exited meanwhile
                sizes.append(proc.memory_info().rss / 2**20)
        if sizes:
            out[role] = round(max(sizes))
    return out


def percentile(values: list[float], q: float) -> float:
    values = sorted(v for v in values if v == v)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summarize(traces: list[RequestTrace], wall: float) -> dict:
    total = sum(len(t.tokens) for t in traces)
    steps = sum(t.stats.steps for t in traces)
    accepted = sum(t.stats.accepted for t in traces)
    ttft, tpot = [t.ttft for t in traces], [t.tpot for t in traces]
    return {"tokens_per_s": round(total / wall, 2), "requests": len(traces), "tokens": total,
            "ttft_p50_ms": round(1000 * percentile(ttft, 0.5), 1), "ttft_p99_ms": round(1000 * percentile(ttft, 0.99), 1),
            "tpot_p50_ms": round(1000 * percentile(tpot, 0.5), 2), "tpot_p99_ms": round(1000 * percentile(tpot, 0.99), 2),
            "tau": round(1 + accepted / steps, 3) if steps else 0.0}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="tiny", choices=pair_names())
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--requests", type=int, default=2, help="requests per level = this x concurrency (at least 4)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per cell; the median run is reported, all tok/s kept")
    ap.add_argument("--torch-threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("results/bench_concurrency"))
    args = ap.parse_args(argv)
    apply_torch_threads(args.torch_threads)
    from evospec.orchestration.config import AppConfig, config_for_pair
    cfg = AppConfig.from_yaml(config_for_pair(args.pair))  # the service's models, dtypes and quantization
    pair = load_pair(cfg.draft.model, cfg.target.model, static_vocab_path=cfg.target.static_vocab,
                     max_model_len=cfg.target.max_model_len, cooc_path=cfg.draft.cooc)
    decoder = pair.decoder
    max_c = max(args.concurrency)
    convs = PROMPT_SETS["medical"](max(4, args.requests * max_c))  # the same prompts in every mode
    prompts_all = [chat_prompt_ids(pair.tokenizer, c) for c in convs]
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    kv = max_c * (max(len(p) for p in prompts_all) + args.max_tokens + 64)
    runners = {"batched": SchedulerThread(Scheduler(decoder, SchedulerConfig(kv_tokens=kv))).start(),
               "fixed": SchedulerThread(Scheduler(decoder, SchedulerConfig(kv_tokens=kv, adaptive=False))).start()}
    schedulers = {mode: runner.scheduler for mode, runner in runners.items()}
    results: list[dict] = []
    outputs: dict[tuple, list[list[int]]] = {}
    for method in args.methods:  # warm-up: first-call costs (allocator, head gathers) off the clock
        spec = SpecParams(method=method)
        run_loop(decoder, prompts_all[:1], sampling.model_copy(update={"max_tokens": 8}), spec, 1)
        for name in ("batched", "fixed"):
            run_scheduler(schedulers[name], prompts_all[:2], sampling.model_copy(update={"max_tokens": 8}), spec, 2)
    service = contextlib.ExitStack()
    address = None
    if "service" in args.modes:
        from evospec.orchestration.local import free_port, local_service
        address = service.enter_context(local_service(cfg.model_copy(
            update={"grpc_port": free_port(), "http_port": free_port()})))
        for method in args.methods:
            run_service(address, convs[:2], method, 8, 2)
    with service:
        for c in args.concurrency:
            n = max(4, args.requests * c)
            prompts = prompts_all[:n]
            for method in args.methods:
                spec = SpecParams(method=method)
                for mode in args.modes:
                    runs = []
                    for _ in range(args.repeats):
                        row = {"concurrency": c, "method": method, "mode": mode}
                        depth_before = Counter(schedulers[mode].depth_histogram) if mode in schedulers else Counter()
                        start = time.perf_counter()
                        if mode == "service":
                            row.update(run_service(address, convs[:n], method, args.max_tokens, c))
                            row["rss_mb"] = service_rss_mb()
                        else:
                            traces = run_loop(decoder, prompts, sampling, spec, c) if mode == "loop" else \
                                run_scheduler(schedulers[mode], prompts, sampling, spec, c)
                            row.update(summarize(traces, time.perf_counter() - start))
                            row["peak_rss_mb"] = round(peak_rss_mb())
                            outputs[(c, method, mode)] = [t.tokens for t in traces]
                        if mode in schedulers:
                            depths = schedulers[mode].depth_histogram - depth_before
                            row["draft_depth_mean"] = round(sum(k * v for k, v in depths.items())
                                                            / max(1, sum(depths.values())), 2)
                        runs.append(row)
                    row = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]  # the median run
                    row["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
                    results.append(row)
                    print(json.dumps(row), flush=True)
    for runner in runners.values():
        runner.stop()
    for row in results:  # greedy: every in-process mode and method must produce the ar loop's tokens
        ref = outputs.get((row["concurrency"], "ar", "loop"))
        if ref is not None and (row["concurrency"], row["method"], row["mode"]) in outputs:
            row["greedy_identical_to_ar"] = sorted(outputs[(row["concurrency"], row["method"], row["mode"])]) == sorted(ref)
    write_results(args, results)


def ratio_rows(results: list[dict]) -> list[dict]:
    by = {(r["concurrency"], r["method"], r["mode"]): r for r in results}
    rows = []
    for (c, method, mode), r in by.items():
        if mode == "loop":
            continue
        loop, ar = by.get((c, method, "loop")), by.get((c, "ar", mode))
        rows.append({"concurrency": c, "method": method, "mode": mode,
                     "vs_loop": round(r["tokens_per_s"] / loop["tokens_per_s"], 3) if loop else None,
                     "vs_ar_same_mode": round(r["tokens_per_s"] / ar["tokens_per_s"], 3) if ar else None})
    return rows


def write_results(args, results: list[dict]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    ratios = ratio_rows(results)
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "rows": results, "ratios": ratios}, indent=1))
    lines = ["| c | method | mode | tok/s (runs) | vs loop | vs ar | TTFT p50/p99 ms | TPOT p50/p99 ms | τ | depth | "
             "greedy = ar | RSS MB |", "|---" * 12 + "|"]
    ratio_of = {(r["concurrency"], r["method"], r["mode"]): r for r in ratios}
    for r in results:
        q = ratio_of.get((r["concurrency"], r["method"], r["mode"]), {})
        runs = "/".join(str(round(v)) for v in r.get("tokens_per_s_runs", []))
        lines.append(f"| {r['concurrency']} | {r['method']} | {r['mode']} | {r['tokens_per_s']} ({runs}) | "
                     f"{q.get('vs_loop', '')} | {q.get('vs_ar_same_mode', '')} | {r['ttft_p50_ms']}/{r['ttft_p99_ms']} | "
                     f"{r['tpot_p50_ms']}/{r['tpot_p99_ms']} | {r['tau']} | {r.get('draft_depth_mean', '')} | "
                     f"{r.get('greedy_identical_to_ar', '')} | {r.get('peak_rss_mb', r.get('rss_mb', ''))} |")
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    plot(results, args.out / "throughput.png")
    print("\n".join(lines))


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (method, mode) in sorted({(r["method"], r["mode"]) for r in results}):
        pts = sorted((r["concurrency"], r["tokens_per_s"]) for r in results if r["method"] == method and r["mode"] == mode)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linestyle="-" if mode != "loop" else ":",
                label=f"{method} ({mode})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("aggregate tokens/s")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
