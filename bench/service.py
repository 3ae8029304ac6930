"""What a user gets: the service as shipped (its YAML, default settings), driven only through the public API with
realistic prompts at several concurrencies, side by side with plain decoding.

    evospec bench service                      # the real pair as shipped: orchestration/configs/cpu-qwen2.5-coder.yaml
    evospec bench service --config orchestration/configs/cpu-tiny.yaml --concurrency 1 2 --sets chat --max-tokens 16
    evospec bench service --sets medical-rag --temperatures 0 --concurrency 1 4 --requests-per-cell 1 \\
                          --arms ar evospec oracle --oracle-depths 2 4      # ~20 min on the real pair, 2 cores

One private local Ray cluster (orchestration/local.py). Phases, one service at a time (memory):
1. **main**: the YAML exactly as shipped (free ports only). Arms `ar`, `frspec`, `evospec`, `lookup`: each request
   sets only `method`, everything else is the service's default (its `default_spec`, the load-adaptive draft depth).
2. **oracle**: a second service from the same YAML with `target.scheduler.adaptive: false`, started after the first
   one is shut down. It runs `evospec` at each fixed depth of `--oracle-depths` (the default shape cut to that depth:
   a chain's `num_draft_tokens`; a tree's `depth` with the node `budget` such a tree can use, as the scheduler's
   `clip_depth` cuts it). Per cell the `oracle` row is the best of {`ar`, each fixed depth} in hindsight, by aggregate
   tok/s, and says which won: what a perfect depth controller would have got.
3. **in process** (`--in-process-ar`, default on): the same prompts at c=1, method `ar`, through the engine the
   service runs (the `Scheduler` with the YAML's settings over the target loaded as the YAML says) in this process,
   after the services are down: what the service itself costs (Ray Serve, the gRPC front, streaming) against plain
   decoding in process.

A **cell** is (prompt set x temperature x concurrency). Within a phase the arms of a cell run back to back over the
same requests, order reversed on every other cell and repeat, so machine drift hits all alike. At concurrency c a
cell sends `--requests-per-cell x c` requests through a closed loop that keeps c in flight (each of the c slots runs
`--requests-per-cell` requests in turn; default 2, so the cell is more than one burst). Greedy unless T > 0; T > 0
requests carry the seed `--seed` (gRPC front; the load generator's OpenAI path sends no seed). The output length is
up to `--max-tokens` (EOS ends a request early, as it would for a user; `--ignore-eos` fixes it).

Prompt sets (evospec/datasets.py, REALISTIC_PROMPT_SETS): `medical-rag` (a held-out PubMedQA item's numbered
contexts, then its question, answer briefly citing the context: ~190-670 tokens, median ~390), `code` (standard
library function stubs: signature + docstring, "complete the body"), `chat` (a held-out PubMedQA question, its long
answer as the assistant turn, then a follow-up question).

Per arm and cell: aggregate output tok/s (all output tokens / the cell's wall time), per-request tok/s (output tokens
/ end-to-end latency: median, min, max), TTFT and TPOT p50/p90 (vLLM's definitions: loadtest/run.py), τ (1 +
accepted / steps over the cell), mean draft depth (SpecStats drafted_levels / steps summed over the cell: the
load-adaptive depth the scheduler chose, 0 = plain steps), ratio to `ar` and to the oracle, errors; prompt lengths;
each service's start-up time (launch -> answering Info). Every file records the CPU (model, torch's capability,
flags), torch threads, the git commit and both configs.

Writes to --out (default results/bench_service): service.json (everything, per request too), service.md (tables per
set x temperature: rows arm x concurrency; the oracle's candidates), throughput.png (tok/s vs concurrency per arm,
one panel per set/temperature), ttft.png (TTFT vs prompt length per arm, one panel per concurrency).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from evospec.bench.harness import summarize as min_median_max
from evospec.config import TreeParams, clip_depth
from evospec.datasets import REALISTIC_PROMPT_SETS
from evospec.loadtest.datasets import LoadRequest, build_requests
from evospec.loadtest.run import RequestResult, run_load
from evospec.loadtest.run import summarize as summarize_load

DEFAULT_CONFIG = "orchestration/configs/cpu-qwen2.5-coder.yaml"
ARMS = ("ar", "frspec", "evospec", "lookup", "oracle")
SERVICE_ARMS = ("ar", "frspec", "evospec", "lookup")  # run on the main service with only `method` set
IN_PROCESS = "ar-in-process"
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
WARMUP = LoadRequest([{"role": "user", "content": "Say hello in one short sentence."}], max_tokens=8)


# ---- requests and options -----------------------------------------------------------------------------------------

def requests_per_cell(concurrency: int, per_slot: int) -> int:
    """Requests of a cell at this concurrency: each of the c slots of the closed loop runs `per_slot` in turn."""
    return max(concurrency, per_slot * concurrency)


def fixed_depth_options(tree: TreeParams, depth: int) -> dict:
    """Request options of the service's default shape cut to `depth` levels (a chain: num_draft_tokens; a tree:
    depth and the node budget such a tree can use, `clip_depth`); deeper than the shape: the shape lengthened."""
    cut = clip_depth(tree, depth) if depth <= tree.levels else tree.model_copy(
        update={"num_draft_tokens": depth} if tree.shape == "chain" else {"depth": depth})
    if cut.shape == "chain":
        return {"shape": "chain", "num_draft_tokens": cut.num_draft_tokens}
    return {"shape": "tree", "depth": cut.depth, "budget": cut.budget}


def depth_arm(depth: int) -> str:
    return f"fixed-d{depth}"


def request_options(base: dict, temperature: float, seed: int, api: str) -> dict:
    """An arm's options for one temperature: sampled requests carry the seed (the SDK takes it as a request option;
    the load generator's OpenAI path puts options in `speculation`, where a seed does not belong)."""
    return {**base, "seed": seed} if temperature > 0 and api == "grpc" else dict(base)


# ---- summaries --------------------------------------------------------------------------------------------------

def request_rows(results: list[RequestResult], **labels) -> list[dict]:
    """One record per request: what ttft.png plots and what a reader can re-aggregate (with the draft model's
    seconds, which tell a step drafted by the model from one verifying a prompt-lookup chain)."""
    rows = []
    for r in results:
        steps = r.stats.get("steps", 0)
        rows.append({**labels, "ok": r.ok, "error": r.error, "prompt_tokens": r.stats.get("prompt_tokens"),
                     "output_tokens": r.output_tokens, "ttft_ms": round(1000 * r.ttft, 2),
                     "tpot_ms": round(1000 * r.tpot, 2), "e2el_ms": round(1000 * r.e2el, 2),
                     "tau": round(1 + r.stats.get("accepted", 0) / steps, 3) if steps else None,
                     "mean_depth": round(r.stats.get("drafted_levels", 0) / steps, 3) if steps else None,
                     # the draft model's share (a prompt-lookup chain costs no draft seconds): what a slow cell bought
                     "drafted": r.stats.get("drafted"), "draft_seconds": r.stats.get("draft_seconds"),
                     "finish_reason": r.finish_reason})
    return rows


def cell_summary(results: list[RequestResult], duration: float) -> dict:
    """The figures of one arm on one cell (loadtest's summary, plus per-request speed, depth and prompt lengths)."""
    s = summarize_load(results, duration)
    ok = [r for r in results if r.ok]
    per_request = [r.output_tokens / r.e2el for r in ok if r.e2el > 0]
    steps = sum(r.stats.get("steps", 0) for r in ok)
    levels = sum(r.stats.get("drafted_levels", 0) for r in ok)
    prompts = [r.stats["prompt_tokens"] for r in ok if r.stats.get("prompt_tokens")]
    return {"requests": len(results), "completed": s["completed"], "failed": s["failed"], "errors": s["errors"],
            "duration_s": s["duration_s"], "output_tokens": s["total_output_tokens"],
            "tok_s": s["output_token_throughput"],
            "per_request_tok_s": round(statistics.median(per_request), 3) if per_request else 0.0,
            "per_request_tok_s_range": min_median_max(per_request),
            "ttft_p50_ms": s["ttft_ms"]["median"], "ttft_p90_ms": s["ttft_ms"]["p90"],
            "tpot_p50_ms": s["tpot_ms"]["median"], "tpot_p90_ms": s["tpot_ms"]["p90"],
            "tau": s["tau"], "mean_depth": round(levels / steps, 3) if steps else 0.0,
            "prompt_tokens": min_median_max(prompts)}


def median_run(runs: list[dict]) -> dict:
    """The run with the median aggregate tok/s, with every run's tok/s (min/median/max) attached."""
    row = dict(sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2])
    row["tok_s_runs"] = [r["tok_s"] for r in runs]
    row["tok_s_range"] = min_median_max(row["tok_s_runs"])
    return row


def cell_key(row: dict) -> tuple:
    return row["set"], row["temperature"], row["concurrency"]


def choose_oracle(candidates: dict[str, dict]) -> tuple[str, dict] | None:
    """The best of the candidates ({name: cell summary}: ar and each fixed depth) by aggregate tok/s, among those
    that completed a request; None when none did."""
    usable = {name: s for name, s in candidates.items() if s.get("completed")}
    if not usable:
        return None
    name = max(usable, key=lambda n: usable[n]["tok_s"])
    return name, usable[name]


def oracle_rows(rows: list[dict], candidates: list[dict]) -> list[dict]:
    """One `oracle` row per cell: the best of that cell's `ar` row and its fixed-depth candidates."""
    by_cell: dict[tuple, dict[str, dict]] = {}
    for row in [*[r for r in rows if r["arm"] == "ar"], *candidates]:
        by_cell.setdefault(cell_key(row), {})[row["arm"]] = row
    out = []
    for key, cands in by_cell.items():
        if not any(name != "ar" for name in cands):
            continue  # no fixed depth ran on this cell
        chosen = choose_oracle(cands)
        if chosen is None:
            continue
        name, best = chosen
        out.append({**best, "arm": "oracle", "oracle_choice": name,
                    "oracle_depth": 0 if name == "ar" else int(name.removeprefix("fixed-d")),
                    "oracle_candidates": {n: c["tok_s"] for n, c in sorted(cands.items())}})
    return out


def add_ratios(rows: list[dict]) -> None:
    """vs_ar and vs_oracle of each row: its aggregate tok/s over the same cell's `ar` and `oracle` (the in-process
    row, at c=1, over the service's)."""
    base = {(cell_key(r), r["arm"]): r["tok_s"] for r in rows}
    for r in rows:
        for name, ref in (("vs_ar", "ar"), ("vs_oracle", "oracle")):
            other = base.get((cell_key(r), ref))
            r[name] = round(r["tok_s"] / other, 3) if other else None


# ---- the phases ---------------------------------------------------------------------------------------------------

def progress(msg: str, started: float) -> None:
    print(f"[{time.perf_counter() - started:7.0f}s] {msg}", flush=True)


def run_cells(address: str, api: str, arms: dict[str, dict], prompt_sets: dict[str, list[list[dict]]],
              temperatures: list[float], concurrency: list[int], args, started: float,
              phase: str) -> tuple[list[dict], list[dict]]:
    """Every cell through one service, arms interleaved per cell (order reversed on every other cell and repeat).
    -> (rows: one per arm and cell, the median repeat; per-request records of every repeat)."""
    rows, records = [], []
    cells = [(s, t, c) for s in prompt_sets for t in temperatures for c in concurrency]
    for i, (set_name, temperature, c) in enumerate(cells):
        n = requests_per_cell(c, args.requests_per_cell)
        requests = build_requests(prompt_sets[set_name][:n], args.max_tokens, None, args.seed, temperature,
                                  args.ignore_eos)
        runs: dict[str, list[dict]] = {arm: [] for arm in arms}
        for rep in range(args.repeats):
            order = list(arms) if (i + rep) % 2 == 0 else list(arms)[::-1]
            for arm in order:
                options = request_options(arms[arm], temperature, args.seed, api)
                results, duration = asyncio.run(run_load(address, requests, options, c, float("inf"), 1.0, args.seed,
                                                         args.timeout, progress=False, api=api))
                s = cell_summary(results, duration)
                runs[arm].append(s)
                labels = {"arm": arm, "set": set_name, "temperature": temperature, "concurrency": c, "repeat": rep}
                records += request_rows(results, **labels)
                progress(f"{phase} cell {i + 1}/{len(cells)} {set_name} T={temperature:g} c={c} rep {rep} {arm:>10}: "
                         f"{s['tok_s']:8.2f} tok/s  TTFT p50 {s['ttft_p50_ms']:9.0f} ms  τ {s['tau']:.2f}  "
                         f"depth {s['mean_depth']:.2f}  errors {s['errors'] or 0}", started)
        for arm in arms:
            rows.append({"arm": arm, "set": set_name, "temperature": temperature, "concurrency": c,
                         "phase": phase, **median_run(runs[arm])})
    return rows, records


def every_step_drafts(cfg):
    """`cfg` with the target's scheduler non-adaptive: every step drafts each request's full tree (the oracle
    service's fixed depths, `bench identity --every-step-drafts`)."""
    scheduler = cfg.target.scheduler.model_copy(update={"adaptive": False})
    return cfg.model_copy(update={"target": cfg.target.model_copy(update={"scheduler": scheduler})})


def start_service(cfg, api: str, timeout: float):
    """Enter serve_app on the current Ray cluster; -> (context, load address, Info, launch -> ready seconds)."""
    from evospec.orchestration.local import free_port, serve_app
    from evospec_client import EvoSpecClient
    cfg = cfg.model_copy(update={"grpc_port": free_port(), "http_port": free_port()})
    start = time.perf_counter()
    ctx = serve_app(cfg)
    grpc_address = ctx.__enter__()
    try:
        with EvoSpecClient(grpc_address, timeout=timeout, app_name=cfg.app_name) as client:
            info = client.wait_ready(timeout=timeout)
    except BaseException:
        ctx.__exit__(*sys.exc_info())
        raise
    address = grpc_address if api == "grpc" else f"http://127.0.0.1:{cfg.http_port}"
    return ctx, address, info, round(time.perf_counter() - start, 2)


def run_service_phase(phase: str, cfg, arms: dict[str, dict], prompt_sets, args, started: float,
                      report: dict) -> None:
    progress(f"{phase}: starting the service ({len(arms)} arms: {', '.join(arms)})", started)
    ctx, address, info, startup = start_service(cfg, args.api, args.timeout)
    try:
        report["services"][phase] = {"startup_s": startup, "info": info, "config": config_record(cfg)}
        progress(f"{phase}: ready in {startup:.1f} s on {address} ({args.api}); warming up", started)
        for arm, options in arms.items():  # first-call costs (allocator, head gathers) off the clock
            asyncio.run(run_load(address, [WARMUP], dict(options), 1, float("inf"), 1.0, args.seed, args.timeout,
                                 progress=False, api=args.api))
        rows, records = run_cells(address, args.api, arms, prompt_sets, args.temperatures, args.concurrency, args,
                                  started, phase)
        report["rows" if phase == "main" else "oracle_candidates"] += rows
        report["requests"] += records
    finally:
        ctx.__exit__(None, None, None)
    progress(f"{phase}: service shut down", started)


def timed_ar(scheduler, tokenizer, messages: list[dict], sampling, timeout: float) -> RequestResult:
    """One plain-decoding request through a scheduler in this process, timed as the load generator times a streamed
    one (from before tokenization, as a service request's clock starts before the server tokenizes)."""
    from evospec.config import SpecParams
    from evospec.engine.scheduler import Failed, Finished, TokensOut
    from evospec.tokenizer import chat_prompt_ids
    result = RequestResult(ok=False, max_tokens=sampling.max_tokens)
    done = threading.Event()
    start = time.perf_counter()
    last = [start]

    def sink(event) -> None:  # runs on the scheduler's thread
        now = time.perf_counter()
        if isinstance(event, TokensOut):
            if event.token_ids:
                if result.output_tokens == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last[0])
                last[0] = now
                result.output_tokens += len(event.token_ids)
            return
        if isinstance(event, Finished):
            result.ok, result.finish_reason, result.stats = True, event.finish_reason, event.stats.as_dict()
        elif isinstance(event, Failed):
            result.error = type(event.error).__name__
        result.e2el = now - start
        done.set()

    scheduler.submit(chat_prompt_ids(tokenizer, messages), sampling, SpecParams(method="ar"), sink)
    if not done.wait(timeout):
        result.error = "TIMEOUT"
    return result


def in_process_ar_scheduler(cfg):
    """The engine the service runs (the continuous-batching `Scheduler` with the YAML's scheduler settings, over the
    target loaded as the YAML says), in this process and for plain decoding only: its depth controller is off (`ar`
    never drafts; measuring its cost table would only delay the start). Loaded as the service loads, every torch
    allocation and forward before serving in a thread that ends. -> (scheduler, model, tokenizer)."""
    from evospec.engine.generate import SpeculativeDecoder
    from evospec.engine.scheduler import Scheduler
    from evospec.loading import apply_torch_threads, in_passing_thread, load_model, stop_token_ids
    from evospec.tokenizer import load_tokenizer
    apply_torch_threads(cfg.target.model.torch_threads)

    def load():
        model, folder = load_model(cfg.target.model, "target")
        decoder = SpeculativeDecoder(model, None, max_model_len=cfg.target.max_model_len,
                                     eos_ids=stop_token_ids(folder))
        return Scheduler(decoder, cfg.target.scheduler.model_copy(update={"adaptive": False})), model, folder
    scheduler, model, folder = in_passing_thread(load)
    return scheduler, model, load_tokenizer(str(folder))


def run_in_process_ar(cfg, prompt_sets, args, started: float, report: dict) -> None:
    """The same c=1 requests, plain decoding, through the engine the service runs (in_process_ar_scheduler) in this
    process, with no service up: what Ray Serve, gRPC and the service's request handling cost."""
    import torch

    from evospec.config import SamplingParams
    from evospec.engine.runner import SchedulerThread
    progress("in process: loading the target", started)
    load_start = time.perf_counter()
    scheduler, model, tokenizer = in_process_ar_scheduler(cfg)
    runner = SchedulerThread(scheduler).start()
    report["services"]["in_process"] = {"load_s": round(time.perf_counter() - load_start, 2),
                                        "torch_threads": torch.get_num_threads(),
                                        "target_dtype": str(model.embed_tokens.weight.dtype).removeprefix("torch.")}
    n = requests_per_cell(1, args.requests_per_cell)
    try:
        timed_ar(scheduler, tokenizer, WARMUP.messages, SamplingParams(max_tokens=WARMUP.max_tokens), args.timeout)
        for set_name, convs in prompt_sets.items():
            for temperature in args.temperatures:
                sampling = SamplingParams(max_tokens=args.max_tokens, temperature=temperature,
                                          ignore_eos=args.ignore_eos, seed=args.seed if temperature > 0 else None)
                runs = []
                for rep in range(args.repeats):
                    start = time.perf_counter()
                    results = [timed_ar(scheduler, tokenizer, messages, sampling, args.timeout)
                               for messages in convs[:n]]
                    s = cell_summary(results, time.perf_counter() - start)
                    runs.append(s)
                    labels = {"arm": IN_PROCESS, "set": set_name, "temperature": temperature, "concurrency": 1,
                              "repeat": rep}
                    report["requests"] += request_rows(results, **labels)
                    progress(f"in process {set_name} T={temperature:g} c=1 rep {rep} {IN_PROCESS}: "
                             f"{s['tok_s']:8.2f} tok/s  TTFT p50 {s['ttft_p50_ms']:9.0f} ms", started)
                report["rows"].append({"arm": IN_PROCESS, "set": set_name, "temperature": temperature,
                                       "concurrency": 1, "phase": "in_process", **median_run(runs)})
    finally:
        runner.stop()


# ---- what the results record ------------------------------------------------------------------------------------

def git_commit() -> dict:
    root = Path(__file__).resolve().parents[1]

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD") or "unknown", "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": None}


SECRETS = {"draft": {"internal": {"secret"}}, "target": {"draft_link": {"secret"}, "public": {"auth_tokens"}}}


def config_record(cfg) -> dict:
    """The service config as run, without its secrets (results files travel)."""
    return cfg.model_dump(mode="json", exclude=SECRETS)


def environment() -> dict:
    """The machine every figure depends on: CPU model, torch's kernel capability, relevant ISA flags, threads."""
    import torch

    from evospec.loading import cpu_description, cpu_flags
    flags = cpu_flags()
    return {"cpu": cpu_description(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_flags": {flag: flag in flags for flag in CPU_FLAGS}, "cpu_count": os.cpu_count(),
            "torch_threads_driver": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "git": git_commit(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


# ---- outputs ------------------------------------------------------------------------------------------------------

ROW_ORDER = (*ARMS, IN_PROCESS)


def fmt(value, digits: int = 3) -> str:
    if value is None or value == "":
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def markdown(report: dict) -> str:
    """Tables per set x temperature (rows arm x concurrency), the oracle's candidates, services and the machine."""
    meta = report["meta"]
    env = meta["environment"]
    lines = [f"# bench service: {meta['config']}", "",
             f"CPU: {env['cpu']}; torch capability {env['cpu_capability']}; flags "
             f"{', '.join(f for f, on in env['cpu_flags'].items() if on) or 'none of ' + ', '.join(env['cpu_flags'])}"
             f"; {env['cpu_count']} CPUs; git {env['git']['commit'][:12]}{' (dirty)' if env['git']['dirty'] else ''}",
             f"api {meta['args']['api']}, max_tokens {meta['args']['max_tokens']}, requests per cell = "
             f"{meta['args']['requests_per_cell']} x concurrency, repeats {meta['args']['repeats']}, oracle depths "
             f"{meta['oracle_depths']}", ""]
    services = report["services"]
    if services:
        lines += ["| service | start-up (launch -> ready) s | target | draft | target dtype |", "|---|---|---|---|---|"]
        for name, s in services.items():
            info = s.get("info", {})
            start = s.get("startup_s", s.get("load_s"))
            lines.append(f"| {name} | {fmt(start)} | {info.get('target_model', '–')} | {info.get('draft_model', '–')} "
                         f"| {info.get('target_dtype', s.get('target_dtype', '–'))} |")
        lines.append("")
    rows = report["rows"]
    groups = sorted({(r["set"], r["temperature"]) for r in rows}, key=lambda g: (g[0], g[1]))
    header = ("| arm | c | tok/s (runs) | per-request tok/s | TTFT p50/p90 ms | TPOT p50/p90 ms | τ | depth | vs ar | "
              "vs oracle | prompt tokens | errors |")
    for set_name, temperature in groups:
        lines += [f"## {set_name}, T={temperature:g}", "", header, "|---" * 12 + "|"]
        group = [r for r in rows if (r["set"], r["temperature"]) == (set_name, temperature)]
        group.sort(key=lambda r: (ROW_ORDER.index(r["arm"]) if r["arm"] in ROW_ORDER else 99, r["concurrency"]))
        for r in group:
            arm = r["arm"] + (f" ({r['oracle_choice']})" if r.get("oracle_choice") else "")
            runs = "/".join(fmt(v) for v in r.get("tok_s_runs", []))
            p = r.get("prompt_tokens") or {}
            prompt = f"{p['median']:.0f} ({p['min']:.0f}–{p['max']:.0f})" if p else "–"
            errors = sum(r["errors"].values()) if r.get("errors") else 0
            lines.append(f"| {arm} | {r['concurrency']} | {fmt(r['tok_s'])} ({runs}) | {fmt(r['per_request_tok_s'])} | "
                         f"{fmt(r['ttft_p50_ms'], 4)}/{fmt(r['ttft_p90_ms'], 4)} | "
                         f"{fmt(r['tpot_p50_ms'], 4)}/{fmt(r['tpot_p90_ms'], 4)} | {fmt(r['tau'])} | "
                         f"{fmt(r['mean_depth'])} | {fmt(r.get('vs_ar'))} | {fmt(r.get('vs_oracle'))} | {prompt} | "
                         f"{errors} |")
        oracle = [r for r in group if r["arm"] == "oracle"]
        if oracle:
            names = sorted({n for r in oracle for n in r["oracle_candidates"]},
                           key=lambda n: (n != "ar", int(n.removeprefix("fixed-d")) if n != "ar" else 0))
            lines += ["", "Oracle candidates (aggregate tok/s; the service with adaptive depth off; **winner**):", "",
                      "| c | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
            for r in oracle:
                cells = [(f"**{fmt(r['oracle_candidates'][n])}**" if n == r["oracle_choice"]
                          else fmt(r["oracle_candidates"][n])) if n in r["oracle_candidates"] else "–" for n in names]
                lines.append(f"| {r['concurrency']} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["tok/s: all output tokens of the cell / its wall time; per-request tok/s: output tokens / end-to-end "
              "latency (median); depth: mean draft depth the scheduler chose (drafted levels / steps; 0 = plain "
              f"steps); vs ar / vs oracle: tok/s ratios on the same cell ({IN_PROCESS}: the target in this process, "
              "no service, same c=1 prompts). Compare within a run, never across runs: this machine is noisy.", ""]
    return "\n".join(lines)


def plot_throughput(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = sorted({(r["set"], r["temperature"]) for r in rows})
    fig, axes = plt.subplots(1, max(1, len(groups)), figsize=(4.6 * max(1, len(groups)), 4), squeeze=False)
    for ax, (set_name, temperature) in zip(axes[0], groups):
        group = [r for r in rows if (r["set"], r["temperature"]) == (set_name, temperature)]
        for arm in ROW_ORDER:
            pts = sorted((r["concurrency"], r["tok_s"]) for r in group if r["arm"] == arm)
            if not pts:
                continue
            style = dict(marker="*", markersize=11, linestyle="none") if arm == IN_PROCESS else \
                dict(marker="o", linestyle="--" if arm == "oracle" else "-")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=arm, **style)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens / s (aggregate)")
        ax.set_title(f"{set_name}, T={temperature:g}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ttft_points(report: dict) -> list[dict]:
    """Per-request records for ttft.png: every arm's (the median repeat's cell is not singled out: all repeats), the
    oracle's being its winning candidate's requests on each cell."""
    records = [r for r in report["requests"] if r["ok"] and r["prompt_tokens"]]
    winners = {cell_key(r): r["oracle_choice"] for r in report["rows"] if r["arm"] == "oracle"}
    oracle = [{**r, "arm": "oracle"} for r in records if winners.get(cell_key(r)) == r["arm"]]
    return [r for r in records if r["arm"] in ROW_ORDER] + oracle


def plot_ttft(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    points = ttft_points(report)
    levels = sorted({r["concurrency"] for r in points}) or [1]
    fig, axes = plt.subplots(1, len(levels), figsize=(4.2 * len(levels), 3.8), squeeze=False)
    for ax, c in zip(axes[0], levels):
        for arm in ROW_ORDER:
            pts = [(r["prompt_tokens"], r["ttft_ms"] / 1000) for r in points
                   if r["arm"] == arm and r["concurrency"] == c]
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=14, alpha=0.7, label=arm,
                           marker="*" if arm == IN_PROCESS else "o")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"concurrency {c}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "service.json").write_text(json.dumps(report, indent=1, default=str))
    md = markdown(report)
    (out / "service.md").write_text(md)
    plot_throughput(report["rows"], out / "throughput.png")
    plot_ttft(report, out / "ttft.png")
    print(md)


# ---- command line -------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="evospec bench service", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=DEFAULT_CONFIG, help=f"the service YAML, as shipped (default {DEFAULT_CONFIG}"
                                                             ", the real pair; fetch it first: evospec models fetch)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--sets", nargs="+", default=list(REALISTIC_PROMPT_SETS), choices=list(REALISTIC_PROMPT_SETS))
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--oracle-depths", type=int, nargs="+",
                    help="fixed draft depths of the oracle service (default 1..levels of the service's default shape)")
    ap.add_argument("--requests-per-cell", type=int, default=2,
                    help="requests per concurrency slot: a cell at concurrency c sends this x c requests (default 2)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each cell (the median run is reported)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens (default: EOS ends)")
    ap.add_argument("--api", choices=["grpc", "openai"], default="grpc",
                    help="the public front to drive: the gRPC SDK or the OpenAI-compatible HTTP API")
    ap.add_argument("--in-process-ar", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the c=1 requests through the target in this process (no service up)")
    ap.add_argument("--seed", type=int, default=0, help="prompt order, and the seed of sampled requests")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per request (and for each start-up)")
    ap.add_argument("--num-cpus", type=int, default=4, help="CPUs of the local Ray cluster (as `evospec serve`)")
    ap.add_argument("--out", type=Path, default=Path("results/bench_service"))
    args = ap.parse_args(argv)
    for name in ("concurrency", "requests_per_cell", "repeats", "max_tokens"):
        values = getattr(args, name)
        if min(values if isinstance(values, list) else [values]) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.oracle_depths is not None and min(args.oracle_depths) < 1:
        ap.error("--oracle-depths must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from evospec.orchestration.config import AppConfig, resolve_config_path
    from evospec.orchestration.local import local_ray
    started = time.perf_counter()
    cfg = AppConfig.from_yaml(args.config)
    tree = cfg.target.default_spec.tree
    depths = sorted(set(args.oracle_depths or range(1, tree.levels + 1)))
    oracle_cfg = every_step_drafts(cfg)
    n_max = requests_per_cell(max(args.concurrency), args.requests_per_cell)
    prompt_sets = {name: REALISTIC_PROMPT_SETS[name](n_max, args.seed) for name in args.sets}
    report = {"meta": {"suite": "service", "argv": sys.argv if argv is None else ["evospec", "bench", "service", *argv],
                       "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                       "config": str(resolve_config_path(args.config)), "default_spec":
                       cfg.target.default_spec.model_dump(mode="json"), "oracle_depths": depths,
                       "oracle_override": {"target.scheduler.adaptive": False},
                       "seeded_sampling": args.api == "grpc", "environment": environment()},
              "services": {}, "rows": [], "oracle_candidates": [], "requests": []}
    main_arms = {arm: {"method": arm} for arm in SERVICE_ARMS if arm in args.arms}
    oracle_arms = {depth_arm(d): {"method": "evospec", **fixed_depth_options(tree, d)} for d in depths} \
        if "oracle" in args.arms else {}
    if "oracle" in args.arms and "ar" not in main_arms:
        print("note: `ar` is not among the arms: the oracle is the best fixed depth only", flush=True)
    cells = len(args.sets) * len(args.temperatures) * len(args.concurrency)
    requests = sum(requests_per_cell(c, args.requests_per_cell) for c in args.concurrency)
    print(f"bench service: {cfg.app_name} from {args.config}; {cells} cells x ({len(main_arms)} main + "
          f"{len(oracle_arms)} oracle arms) x {args.repeats} repeats; "
          f"{len(args.sets) * len(args.temperatures) * requests * (len(main_arms) + len(oracle_arms)) * args.repeats}"
          f" requests", flush=True)
    ray_start = time.perf_counter()
    with local_ray(num_cpus=args.num_cpus):
        report["services"]["ray"] = {"startup_s": round(time.perf_counter() - ray_start, 2)}
        if main_arms:
            run_service_phase("main", cfg, main_arms, prompt_sets, args, started, report)
        if oracle_arms:
            run_service_phase("oracle", oracle_cfg, oracle_arms, prompt_sets, args, started, report)
    if args.in_process_ar:
        run_in_process_ar(cfg, prompt_sets, args, started, report)
    report["rows"] += oracle_rows(report["rows"], report["oracle_candidates"])
    add_ratios(report["rows"])
    report["meta"]["wall_s"] = round(time.perf_counter() - started, 1)
    write_outputs(report, args.out)
    failed = sum(r["failed"] for r in [*report["rows"], *report["oracle_candidates"]])
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
