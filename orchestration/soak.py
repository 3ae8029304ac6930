"""`evospec soak`: steady load for a while, watching each service process's memory and greedy output.

`concurrency` client threads send greedy streaming requests back to back (medical questions, methods in turn) for
`duration` seconds. The first answer to each (prompt, method, max_tokens) is the reference: every later answer to it
must be identical, and every method's must equal `ar`'s (lossless). Every `interval` seconds it prints the resident
memory of the Target and Draft replica processes (found on this machine by their Ray process titles), and at the end
the growth after the first minute (warm-up): the goal is < 5%.

    evospec soak --duration 600 --concurrency 8                 # starts a local service (cpu-tiny.yaml)
    evospec soak --address 127.0.0.1:9000 --duration 600        # a running service on this machine
"""
from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time
from dataclasses import dataclass, field

from evospec.orchestration.local import replica_processes, service_to_drive

METHODS = ("evospec", "frspec", "sd", "ar")


def rss_mb(processes: dict[str, list]) -> dict[str, float]:
    out = {}
    for role, procs in processes.items():
        total = 0
        for proc in procs:
            with contextlib.suppress(Exception):  # a replica that restarted: counted as gone
                total += proc.memory_info().rss
        out[role] = total / 2**20
    return out


@dataclass
class SoakState:
    references: dict[tuple, list[int]] = field(default_factory=dict)
    requests: int = 0
    tokens: int = 0
    mismatches: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, key: tuple, tokens: list[int]) -> None:
        """key = (method, prompt index, max_tokens). The first answer to a key is its reference; `ar`'s answer to the
        same prompt is every method's (lossless greedy)."""
        with self.lock:
            self.requests += 1
            self.tokens += len(tokens)
            reference = self.references.setdefault(key, tokens)
            target_only = self.references.get(("ar", *key[1:]))
            if reference != tokens or (target_only is not None and target_only != tokens):
                self.mismatches += 1


def _worker(address: str, prompts: list, max_tokens: int, worker: int, stop: threading.Event, state: SoakState,
            token: str | None, app_name: str) -> None:
    from evospec_client import EvoSpecClient
    i = worker
    with EvoSpecClient(address, timeout=300, token=token, app_name=app_name) as client:
        while not stop.is_set():
            method = METHODS[i % len(METHODS)]
            prompt = i // len(METHODS) % len(prompts)
            i += 7  # workers interleave over (prompt, method) pairs
            try:
                done = client.generate(messages=prompts[prompt], max_tokens=max_tokens, method=method)
                state.record((method, prompt, max_tokens), done.token_ids)
            except Exception as exc:  # noqa: BLE001 - counted and sampled, the soak goes on
                with state.lock:
                    state.errors += 1
                    if len(state.error_samples) < 5:
                        state.error_samples.append(f"{type(exc).__name__}: {exc}"[:200])


def run_soak(address: str, duration_s: float, concurrency: int, interval_s: float = 10.0, max_tokens: int = 64,
             num_prompts: int = 16, token: str | None = None, app_name: str = "evospec") -> dict:
    from evospec.datasets import load_prompts
    prompts = load_prompts("medical", num_prompts, seed=0)
    processes = replica_processes(app_name)
    state, stop = SoakState(), threading.Event()
    threads = [threading.Thread(target=_worker, args=(address, prompts, max_tokens, w, stop, state, token, app_name),
                                daemon=True) for w in range(concurrency)]
    samples: list[dict] = []
    start = time.monotonic()
    for thread in threads:
        thread.start()
    print(f"{'t (s)':>6} {'target MB':>10} {'draft MB':>9} {'requests':>9} {'tok/s':>7} {'mismatch':>9} {'errors':>7}")
    try:
        while (elapsed := time.monotonic() - start) < duration_s:
            time.sleep(min(interval_s, max(0.0, duration_s - elapsed)))
            t = time.monotonic() - start
            sample = {"t": round(t, 1), **{f"{k}_mb": round(v, 1) for k, v in rss_mb(processes).items()},
                      "requests": state.requests, "tokens": state.tokens, "mismatches": state.mismatches,
                      "errors": state.errors}
            samples.append(sample)
            print(f"{sample['t']:>6.0f} {sample['target_mb']:>10.0f} {sample['draft_mb']:>9.0f} {state.requests:>9} "
                  f"{state.tokens / t:>7.1f} {state.mismatches:>9} {state.errors:>7}", flush=True)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=300)
    return summarize(samples, state, warmup_s=min(60.0, duration_s / 4))


def summarize(samples: list[dict], state: SoakState, warmup_s: float = 60.0) -> dict:
    """RSS growth per process from the first sample after warm-up to the end (the mean of the last three samples,
    so one transient peak does not decide it)."""
    growth = {}
    after = [s for s in samples if s["t"] >= warmup_s]
    for role in ("target", "draft"):
        key = f"{role}_mb"
        if len(after) >= 2 and after[0][key] > 0:
            end = sum(s[key] for s in after[-3:]) / len(after[-3:])
            growth[role] = round(100.0 * (end - after[0][key]) / after[0][key], 2)
    return {"requests": state.requests, "tokens": state.tokens, "mismatches": state.mismatches,
            "errors": state.errors, "error_samples": state.error_samples, "warmup_s": warmup_s,
            "rss_growth_after_warmup_pct": growth, "samples": samples}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evospec soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", default=None, help="a running service (default: start one from --config)")
    ap.add_argument("--config", default="cpu-tiny.yaml", help="service config when starting a local service")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--interval", type=float, default=10.0, help="seconds between memory samples")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=16, help="distinct medical questions (fewer = more repeats to "
                                                            "compare on a slow model)")
    ap.add_argument("--token", default=None, help="bearer token (default: $EVOSPEC_API_TOKEN)")
    ap.add_argument("--out", default=None, help="write the summary (with every sample) as JSON here")
    args = ap.parse_args(argv)
    with service_to_drive(args.address, args.config) as (address, app_name):
        summary = run_soak(address, args.duration, args.concurrency, args.interval, args.max_tokens, args.prompts,
                           token=args.token, app_name=app_name)
    print(json.dumps({k: v for k, v in summary.items() if k != "samples"}, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    growth_ok = all(g < 5.0 for g in summary["rss_growth_after_warmup_pct"].values())
    return 0 if summary["mismatches"] == 0 and summary["errors"] == 0 and growth_ok else 1
