"""Greedy identity through the service: the same prompts, greedy, with `ar` and with speculative methods, compared
token for token (README, "Lossless": greedy output is the target's own, on every CPU and dtype).

    evospec bench identity                        # the shipped YAML; medical-rag and code, 4 prompts each, 64 tokens
    evospec bench identity --every-step-drafts    # scheduler.adaptive off: every step drafts the request's full tree
    evospec bench identity --methods evospec sd frspec --concurrency 4

Where the budget finds that drafting does not pay (a quantized target on a 2-core CPU: docs/results.md) a speculative
method drafts nothing and the comparison is trivially equal; `--every-step-drafts` turns the budget off
(`scheduler.adaptive: false`), so every step verifies a tree and the comparison tests the verify forward itself.
Each method's requests run `--concurrency` at a time (c > 1 also tests that a request's tokens do not depend on what
runs beside it). Per method and prompt set: identical answers, the first divergence (token index) of the others,
drafted and accepted tokens; writes identity.json (every request's tokens too) and identity.md under --out.
Never run by the test suite (it needs the real pair); tests/unit/test_lossless_greedy.py covers the same claim on
the tiny pair in process.
"""
from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from evospec.bench.formats import first_divergence
from evospec.bench.service import (DEFAULT_CONFIG, config_record, environment, every_step_drafts, progress,
                                   start_service)
from evospec.datasets import REALISTIC_PROMPT_SETS

BASELINE = "ar"


def divergence(a: list[int], b: list[int]) -> int | None:
    """Where a and b first differ (bench/formats.py `first_divergence`), None when they are equal."""
    return None if a == b else first_divergence(a, b)


def run_method(address: str, method: str, prompts: list[list[dict]], args) -> list[dict]:
    """Every prompt, greedy, with `method`, `args.concurrency` at a time: [{token_ids, drafted, accepted}]."""
    from evospec_client import EvoSpecClient

    def one(messages: list[dict]) -> dict:
        with EvoSpecClient(address, timeout=args.timeout) as client:
            done = client.generate(messages=messages, method=method, temperature=0.0, max_tokens=args.max_tokens)
        return {"token_ids": list(done.token_ids), "finish_reason": done.finish_reason,
                "drafted": int(done.stats.get("drafted", 0)), "accepted": int(done.stats.get("accepted", 0))}

    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        return list(pool.map(one, prompts))


def compare(results: dict[str, dict[str, list[dict]]]) -> list[dict]:
    """Per method (other than ar) and set: identical answers and where the others first diverge."""
    rows = []
    for method, per_set in results.items():
        if method == BASELINE:
            continue
        for set_name, answers in per_set.items():
            reference = results[BASELINE][set_name]
            firsts = [divergence(ours["token_ids"], ref["token_ids"]) for ours, ref in zip(answers, reference)]
            rows.append({"method": method, "set": set_name, "requests": len(answers),
                         "identical": sum(f is None for f in firsts),
                         "first_divergence": [f for f in firsts if f is not None],
                         "drafted": sum(a["drafted"] for a in answers),
                         "accepted": sum(a["accepted"] for a in answers)})
    return rows


def markdown(report: dict) -> str:
    meta = report["meta"]
    setting = (f"CPU: {meta['environment'].get('cpu', '?')}; target {meta['info'].get('target_dtype')}, weights "
               f"{meta['info'].get('target_weights')}; greedy, max_tokens {meta['max_tokens']}, c = "
               f"{meta['concurrency']}; every step drafts: {meta['every_step_drafts']}")
    lines = [f"# bench identity: {meta['config']}", "", setting, "",
             "| method | set | identical to ar | first divergence (token) of the others | drafted | accepted |",
             "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['method']} | {r['set']} | {r['identical']} / {r['requests']} | "
                     f"{', '.join(map(str, r['first_divergence'])) or '-'} | {r['drafted']} | {r['accepted']} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="evospec bench identity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=DEFAULT_CONFIG, help=f"the service YAML (default {DEFAULT_CONFIG})")
    ap.add_argument("--methods", nargs="+", default=["evospec"], choices=["sd", "frspec", "evospec", "lookup"],
                    help="speculative methods compared with ar (default evospec)")
    ap.add_argument("--sets", nargs="+", default=["medical-rag", "code"], choices=list(REALISTIC_PROMPT_SETS))
    ap.add_argument("--requests", type=int, default=4, help="prompts per set (default 4)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=1, help="requests of a method in flight at once (default 1)")
    ap.add_argument("--every-step-drafts", action="store_true",
                    help="scheduler.adaptive off: every step drafts the full tree (tests the verify forward)")
    ap.add_argument("--seed", type=int, default=0, help="prompt order")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per request (and for the start-up)")
    ap.add_argument("--num-cpus", type=int, default=4, help="CPUs of the local Ray cluster (as `evospec serve`)")
    ap.add_argument("--out", type=Path, default=Path("results/bench_identity"))
    args = ap.parse_args(argv)
    if args.requests < 1 or args.max_tokens < 1 or args.concurrency < 1:
        ap.error("--requests, --max-tokens and --concurrency must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    from evospec.orchestration.config import AppConfig
    from evospec.orchestration.local import local_ray
    args = parse_args(argv)
    started = time.perf_counter()
    cfg = AppConfig.from_yaml(args.config)
    if args.every_step_drafts:
        cfg = every_step_drafts(cfg)
    prompts = {name: REALISTIC_PROMPT_SETS[name](args.requests, args.seed) for name in args.sets}
    results: dict[str, dict[str, list[dict]]] = {}
    with local_ray(num_cpus=args.num_cpus):
        ctx, address, info, startup = start_service(cfg, "grpc", args.timeout)
        try:
            progress(f"service ready in {startup:.1f} s (target {info.get('target_dtype')}, weights "
                     f"{info.get('target_weights')})", started)
            for method in [BASELINE, *args.methods]:
                results[method] = {}
                for name, chats in prompts.items():
                    results[method][name] = run_method(address, method, chats, args)
                    progress(f"{method} {name}: {len(chats)} requests", started)
        finally:
            ctx.__exit__(None, None, None)
    report = {"meta": {"config": args.config, "argv": vars(args) | {"out": str(args.out)}, "info": info,
                       "startup_s": startup, "environment": environment(), "service": config_record(cfg),
                       "max_tokens": args.max_tokens, "concurrency": args.concurrency,
                       "every_step_drafts": args.every_step_drafts, "wall_s": round(time.perf_counter() - started)},
              "rows": compare(results), "answers": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "identity.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / "identity.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if all(r["identical"] == r["requests"] for r in report["rows"]) else 1
