"""Compare methods under closed-loop concurrency on one service, side by side in one run.

    evospec loadtest-sweep                        # starts the tiny-pair service locally, sweeps, shuts it down
    evospec loadtest-sweep --server HOST:9000 --concurrency 1 4 16 32 --methods ar sd frspec evospec

Each point sends `--requests-per-level x concurrency` requests (bounded count and time) and records throughput,
latency percentiles, τ and errors. Writes sweep.json, sweep.md and sweep.png (throughput and p99 E2EL vs
concurrency, one line per method).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from pathlib import Path

from evospec.config import METHODS
from evospec.datasets import load_prompts
from evospec.loadtest.datasets import build_requests
from evospec.loadtest.run import run_load, summarize


def sweep(address: str, methods: list[str], levels: list[int], requests_per_level: int, output_len: int,
          dataset: str, seed: int, timeout: float) -> dict:
    results: dict[str, dict[int, dict]] = {m: {} for m in methods}
    for level in levels:
        n = max(level, requests_per_level * level)
        requests = build_requests(load_prompts(dataset, n, seed + level), output_len, None, seed)
        for method in methods:  # methods interleaved per level: drift hits all alike
            res, duration = asyncio.run(run_load(address, requests, {"method": method}, level, float("inf"), 1.0,
                                                 seed, timeout, progress=False))
            results[method][level] = summarize(res, duration)
            s = results[method][level]
            print(f"c={level:>3} {method:>8}: {s['output_token_throughput']:8.1f} tok/s  "
                  f"p99 E2EL {s['e2el_ms']['p99']:8.1f} ms  tau {s['tau']:.2f}  errors {s['errors']}", flush=True)
    return results


def table(results: dict) -> str:
    lines = ["| method | concurrency | tok/s | req/s | TTFT p50 ms | TPOT p50 ms | E2EL p99 ms | τ | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    for method, by_level in results.items():
        for level, s in by_level.items():
            lines.append(f"| {method} | {level} | {s['output_token_throughput']} | {s['request_throughput']} | "
                         f"{s['ttft_ms']['median']} | {s['tpot_ms']['median']} | {s['e2el_ms']['p99']} | "
                         f"{s['tau']} | {sum(s['errors'].values())} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for method, by_level in results.items():
        levels = sorted(by_level)
        a.plot(levels, [by_level[c]["output_token_throughput"] for c in levels], marker="o", label=method)
        b.plot(levels, [by_level[c]["e2el_ms"]["p99"] for c in levels], marker="o", label=method)
    for ax, label in ((a, "output tokens / s"), (b, "p99 E2EL (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", help="a running service; default: start the tiny-pair service locally")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--requests-per-level", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--dataset", default="medical")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path, default=Path("results/sweep"))
    args = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        address = args.server
        if address is None:
            from evospec.orchestration.config import DEFAULT_CONFIG, AppConfig
            from evospec.orchestration.local import free_port, local_service
            cfg = AppConfig.from_yaml(DEFAULT_CONFIG).model_copy(
                update={"grpc_port": free_port(), "http_port": free_port()})
            address = stack.enter_context(local_service(cfg))
        results = sweep(address, args.methods, args.concurrency, args.requests_per_level, args.output_len,
                        args.dataset, args.seed, args.timeout)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                     "results": results}, indent=1))
    md = table(results)
    (args.out / "sweep.md").write_text(md)
    plot(results, args.out / "sweep.png")
    print(md)
    failed = sum(s["failed"] for by in results.values() for s in by.values())
    return 0 if failed == 0 else 1
