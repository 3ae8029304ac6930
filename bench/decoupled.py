"""What decoupling costs and what overlap wins back: the same methods and prompts, side by side in one run, three ways.

    evospec bench decoupled [--pair tiny|qwen2.5-coder] [--repeats 3] [--prompts 4] [--max-tokens 48]
                            [--concurrency 1 8] [--methods sd frspec evospec] [--breakdown] [--transport local]

- in-process: both models in this process, one continuous-batching scheduler (the service's engine) with its draft
  in process, torch on every core;
- decoupled: the service (Ray Serve + gRPC), draft and target in their own replicas, no pre-drafting;
- overlap: the same service with pre-drafting (the draft drafts the likeliest outcomes' next trees while the target
  verifies; docs/decoupled.md).

`--transport local` runs decoupled and overlap without Ray (where Ray is not installed, e.g. scripts/gpu_check.sh on a
GPU image): the draft replica in its own process behind the same speculation stream, the target replica's engine in
this process, requests handed to that engine directly (so the public API's cost is not in its figures).

Both sides load the models from the same service config (orchestration/configs/cpu-<pair>.yaml). Each repeat runs
every (method, concurrency) cell in each mode, interleaved; repeat 0 warms up and is not recorded. Greedy, so every
mode must give the same tokens (counted as mismatches otherwise). --breakdown prints where an engine step's time goes
(evospec/engine/profile.py: ms per engine step by span, from the scheduler's spans and the draft replica's own
report), the share of the draft's compute hidden under verification (overlap ratio) and how many trees were
pre-drafted. Writes results/bench_decoupled/bench_decoupled.{json,md} and decoupled.png.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from evospec.bench.projection import from_profile
from evospec.bench.prompts import PROMPT_SETS
from evospec.config import METHODS, SamplingParams, SpecParams
from evospec.engine.profile import DRAFT_PARTS, HIDDEN_PARTS, STEP_SPANS, ms_per_step
from evospec.loading import LoadedPair, apply_torch_threads, load_pair, load_static_ids
from evospec.modelstore.catalog import pair_names
from evospec.tokenizer import chat_prompt_ids

if TYPE_CHECKING:
    from evospec.orchestration.config import AppConfig

MODES = ("in-process", "decoupled", "overlap")


def run_in_process(scheduler, prompts: list[list[int]], max_tokens: int, method: str,
                   cpus: set[int] | None = None, predraft: bool = True) -> dict:
    """Every prompt submitted at once to a scheduler in this process, stepped until idle (on `cpus` when given).
    The scheduler's draft is in process, or remote (the local transport's draft replica process)."""
    allowed = os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        return _run_in_process(scheduler, prompts, max_tokens, method, predraft)
    finally:
        os.sched_setaffinity(0, allowed)


def _run_in_process(scheduler, prompts: list[list[int]], max_tokens: int, method: str, predraft: bool) -> dict:
    from evospec.engine.scheduler import Finished, TokensOut
    outputs = [[] for _ in prompts]
    stats = [None] * len(prompts)

    def sink_for(i):
        def sink(event):
            if isinstance(event, TokensOut):
                outputs[i].extend(event.token_ids)
            elif isinstance(event, Finished):
                stats[i] = event.stats.as_dict()
            else:
                raise RuntimeError(f"in-process generation failed: {event}")
        return sink
    scheduler.profile.reset()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        scheduler.submit(p, SamplingParams(max_tokens=max_tokens), SpecParams(method=method, predraft=predraft),
                         sink_for(i))
    scheduler.run_until_idle()
    wall = time.perf_counter() - start
    return {"wall": wall, "outputs": outputs, "stats": stats, "profile": scheduler.profile.as_dict()}


# A decoupled run: (conversations, their prompt ids, max tokens, method, pre-drafting) -> a run's figures.
RunDecoupled = Callable[[list[list[dict]], list[list[int]], int, str, bool], dict]


@contextlib.contextmanager
def serve_transport(cfg: "AppConfig") -> Iterator[RunDecoupled]:
    """The service as deployed (Ray Serve, a private local cluster), called through its public gRPC API."""
    from ray import serve

    from evospec.orchestration.local import local_service
    from evospec_client import EvoSpecClient
    with local_service(cfg) as address, EvoSpecClient(address, timeout=600) as client:
        client.wait_ready()
        target = serve.get_deployment_handle("Target", cfg.app_name)
        yield lambda convs, _, max_tokens, method, predraft: run_service(client, target, convs, max_tokens, method,
                                                                         predraft)


@contextlib.contextmanager
def local_transport(cfg: "AppConfig", pair: LoadedPair) -> Iterator[RunDecoupled]:
    """The decoupled data plane without Ray: the draft replica in its own process behind the speculation stream
    (orchestration/draft_process.py), the target replica's engine (the service's scheduler with its remote drafter)
    in this process on `pair`'s target model. Requests go straight to that engine: no public API, no Serve proxy."""
    from evospec.orchestration.draft_process import local_draft_replica
    from evospec.services.target.draft_link import DraftReplicas
    from evospec.services.target.server import remote_draft_scheduler
    secret = secrets.token_urlsafe(32)
    draft_cfg = cfg.draft.model_copy(update={"internal": cfg.draft.internal.model_copy(update={"secret": secret})})
    link = cfg.target.draft_link.model_copy(update={"secret": secret, "replicas": 1})
    with local_draft_replica(draft_cfg) as address:
        pool = DraftReplicas(lambda: [address], link)
        try:
            if not pool.wait_healthy(1, timeout_s=60):
                raise RuntimeError(f"the local draft replica at {address} did not answer its health check in 60 s")
            _, sha = load_static_ids(cfg.target.static_vocab)
            scheduler = remote_draft_scheduler(pair.decoder.target.model, pair.stop_ids,
                                               pair.decoder.policies.static_ids, sha, cfg.target, pool)
            yield lambda _, prompts, max_tokens, method, predraft: run_in_process(scheduler, prompts, max_tokens,
                                                                                  method, predraft=predraft)
        finally:
            pool.close()


def run_service(client, target, convs: list[list[dict]], max_tokens: int, method: str, predraft: bool) -> dict:
    """Every conversation sent at once (one thread each) through the public gRPC API."""
    target.profile.remote(reset=True).result()
    start = time.perf_counter()
    with ThreadPoolExecutor(len(convs)) as pool:
        done = list(pool.map(lambda c: client.generate(messages=c, max_tokens=max_tokens, method=method,
                                                       predraft=predraft), convs))
    wall = time.perf_counter() - start
    return {"wall": wall, "outputs": [list(d.token_ids) for d in done], "stats": [d.stats for d in done],
            "profile": target.profile.remote().result()}


def overlap_figures(profile: dict, stats: list[dict]) -> dict:
    """Overlap ratio = draft compute done while the target verified (feedback commits, pre-drafting) / all draft
    compute; predraft use = trees answered from a pre-draft / the requests' steps (prefill and depth-0 steps too)."""
    s = profile["seconds"]
    hidden = sum(s.get(k, 0.0) for k in HIDDEN_PARTS)
    total = hidden + s.get("draft.remote_compute", 0.0)
    steps = sum(st["steps"] - st["fallback_steps"] for st in stats)
    return {"overlap_ratio": hidden / total if total else 0.0,
            "predraft_use": sum(st.get("predrafted_steps", 0) for st in stats) / steps if steps else 0.0}


def breakdown_table(cells: dict) -> str:
    spans = [*STEP_SPANS[:3], *DRAFT_PARTS, *STEP_SPANS[3:], *HIDDEN_PARTS]
    lines = ["| cell | mean depth | ms / engine step (wall) | " + " | ".join(spans) + " |",
             "|---|---|---|" + "---|" * len(spans)]
    for name, runs in cells.items():
        per_step = [ms_per_step(r["profile"]) for r in runs]
        wall = statistics.median(1000 * r["wall"] / max(1, r["profile"]["steps"]) for r in runs)
        depth = statistics.median(sum(k * n for k, n in r["profile"]["depths"].items()) / max(1, r["profile"]["steps"])
                                  for r in runs)
        row = [f"{statistics.median(p.get(span, 0.0) for p in per_step):.2f}" for span in spans]
        lines.append(f"| {name} | {depth:.2f} | {wall:.2f} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def model_check(cells: dict) -> str:
    """The step model of bench/projection.py fed with each c = 1 cell's measured terms (V, D, T from the decoupled
    runs; P and the pre-draft hit share from the overlap runs) against the overlap runs' measured engine speed."""
    lines = ["Step model (bench/projection.py) vs measured tokens/s, c = 1 (tokens/s: median over repeats; the terms "
             "shown: one repeat's; draft terms per drafting step, s = share of steps that drafted):", "",
             "| method | V ms | D ms | T ms | P ms | s | hit | tau | decoupled: model / measured | "
             "overlap: model / measured |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (method, c), modes in cells.items():
        if c != 1 or method == "ar":
            continue
        rows = []
        for dec, ovl in zip(modes["decoupled"], modes["overlap"]):
            levels = max(1.0, mean_depth(dec["profile"]))
            d = from_profile(dec["profile"], dec["stats"], levels)
            o = from_profile(ovl["profile"], ovl["stats"], levels)
            model = replace(d, predraft=o.predraft, hit=o.hit, tau=o.tau)
            measured = {name: tokens(run) / run["wall"] for name, run in (("dec", dec), ("ovl", ovl))}
            rows.append((d, o, d.tokens_per_s(d.decoupled_ms()), measured["dec"],
                         model.tokens_per_s(model.overlap_ms()), measured["ovl"]))
        med = statistics.median
        d = rows[len(rows) // 2][0]
        o = rows[len(rows) // 2][1]
        lines.append(f"| {method} | {d.verify:.1f} | {d.draft:.1f} | {d.transport:.1f} | {o.predraft:.1f} | "
                     f"{d.drafting:.2f} | {o.hit:.0%} | {d.tau:.2f} | {med(r[2] for r in rows):.1f} / {med(r[3] for r in rows):.1f} | "
                     f"{med(r[4] for r in rows):.1f} / {med(r[5] for r in rows):.1f} |")
    return "\n".join(lines) + "\n"


def mean_depth(profile: dict) -> float:
    drafting = {int(k): n for k, n in profile.get("depths", {}).items() if int(k) > 0}
    return sum(k * n for k, n in drafting.items()) / sum(drafting.values()) if drafting else 0.0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    concurrencies = sorted({r["concurrency"] for r in rows})
    fig, axes = plt.subplots(1, len(concurrencies), figsize=(5 * len(concurrencies), 3.5), squeeze=False)
    for ax, c in zip(axes[0], concurrencies):
        cell = [r for r in rows if r["concurrency"] == c]
        methods = list(dict.fromkeys(r["method"] for r in cell))
        width = 0.8 / len(MODES)
        for i, mode in enumerate(MODES):
            values = [next(r["tok_s"][mode] for r in cell if r["method"] == m) for m in methods]
            ax.bar([x + i * width for x in range(len(methods))], values, width, label=mode)
        ax.set_xticks([x + width for x in range(len(methods))], methods)
        ax.set_title(f"concurrency {c}")
        ax.set_ylabel("tokens / s (median)")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=len(MODES))
    fig.tight_layout(rect=(0, 0.08, 1, 1))  # room for the legend under the bars
    fig.savefig(path, dpi=120)


def service_config(args) -> "AppConfig":
    """The pair's service config with the command line's overrides (threads, cores, hypotheses, stream interval,
    full trees); free ports."""
    from evospec.orchestration.config import AppConfig, config_for_pair
    cfg = AppConfig.from_yaml(args.config or config_for_pair(args.pair)).model_copy(
        update={"grpc_port": 0, "http_port": 0})
    for role in ("draft", "target"):
        update = {"torch_threads": getattr(args, f"{role}_threads"), "cpu_affinity": getattr(args, f"{role}_cpus")}
        update = {k: tuple(v) if isinstance(v, list) else v for k, v in update.items() if v is not None}
        side = getattr(cfg, role)
        side = side.model_copy(update={"model": side.model.model_copy(update=update)})
        cfg = cfg.model_copy(update={role: side})
    if args.hypotheses is not None:
        cfg = cfg.model_copy(update={"draft": cfg.draft.model_copy(update={"predraft_hypotheses": args.hypotheses})})
    if args.stream_interval is not None:
        public = cfg.target.public.model_copy(update={"stream_interval": args.stream_interval})
        cfg = cfg.model_copy(update={"target": cfg.target.model_copy(update={"public": public})})
    if args.full_trees:
        scheduler_cfg = cfg.target.scheduler.model_copy(update={"adaptive": False})
        cfg = cfg.model_copy(update={"target": cfg.target.model_copy(update={"scheduler": scheduler_cfg})})
    return cfg


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="tiny", choices=pair_names())
    ap.add_argument("--config", help="service config (default orchestration/configs/cpu-<pair>.yaml)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4, help="requests per cell at concurrency 1")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--methods", nargs="+", default=["sd", "frspec", "evospec"], choices=METHODS)
    ap.add_argument("--breakdown", action="store_true", help="print ms per engine step by span")
    ap.add_argument("--in-process-threads", type=int, default=os.cpu_count(),
                    help="torch threads of the in-process run (default: every core)")
    ap.add_argument("--in-process-cpus", type=int, nargs="+", help="pin the in-process run to these CPUs")
    ap.add_argument("--draft-cpus", type=int, nargs="+", help="pin the draft replica to these CPUs")
    ap.add_argument("--target-cpus", type=int, nargs="+", help="pin the target replica to these CPUs")
    ap.add_argument("--draft-threads", type=int, help="torch threads of the draft replica (default: the config's)")
    ap.add_argument("--target-threads", type=int, help="torch threads of the target replica (default: the config's)")
    ap.add_argument("--hypotheses", type=int, help="pre-drafted outcomes per tree (default: the config's "
                                                  "draft.predraft_hypotheses)")
    ap.add_argument("--stream-interval", type=int, help="tokens per streamed message (target.public.stream_interval)")
    ap.add_argument("--full-trees", action="store_true",
                    help="draft every request's full tree each step (scheduler.adaptive off) on both sides")
    ap.add_argument("--transport", choices=["serve", "local"], default="serve",
                    help="serve: the service on Ray Serve through its public gRPC API; local: no Ray, the draft "
                         "replica in its own process, the target's engine in this one (the data plane alone)")
    ap.add_argument("--out", type=Path, default=Path("results/bench_decoupled"))
    args = ap.parse_args(argv)
    if args.transport == "local" and (args.target_cpus or args.target_threads):
        ap.error("--target-cpus/--target-threads: with --transport local the target runs in this process "
                 "(use --in-process-cpus/--in-process-threads)")
    from evospec.engine.scheduler import Scheduler

    cfg = service_config(args)
    apply_torch_threads(args.in_process_threads)  # this process' models (the service's replicas have their own)
    pair = load_pair(cfg.draft.model, cfg.target.model, static_vocab_path=cfg.target.static_vocab,
                     max_model_len=cfg.target.max_model_len, cooc_path=cfg.draft.cooc)
    scheduler = Scheduler(pair.decoder, cfg.target.scheduler)
    convs_all = PROMPT_SETS["medical"](max(args.prompts, max(args.concurrency)))
    cells: dict[tuple[str, int], dict[str, list[dict]]] = {}
    mismatches: Counter = Counter()  # "mode method c=..." -> greedy outputs that differ from in-process
    transport = local_transport(cfg, pair) if args.transport == "local" else serve_transport(cfg)
    with transport as run_decoupled:
        for rep in range(args.repeats + 1):  # repeat 0 warms every path up and is not recorded
            for c in args.concurrency:
                convs = [convs_all[i % len(convs_all)] for i in range(max(c, args.prompts if c == 1 else c))]
                chunks = [convs[i:i + c] for i in range(0, len(convs), c)]
                for method in args.methods:
                    runs = {mode: [] for mode in MODES}
                    for chunk in chunks:
                        prompts = [chat_prompt_ids(pair.tokenizer, conv) for conv in chunk]
                        runs["in-process"].append(run_in_process(scheduler, prompts, args.max_tokens, method,
                                                                 set(args.in_process_cpus or ())))
                        for mode in MODES[1:]:
                            runs[mode].append(run_decoupled(chunk, prompts, args.max_tokens, method,
                                                            mode == "overlap"))
                    for mode, parts in runs.items():
                        merged = merge(parts)
                        mismatches[f"{mode} {method} c={c}"] += sum(
                            a != b for a, b in zip(merged["outputs"], merge(runs["in-process"])["outputs"]))
                        if rep:
                            cells.setdefault((method, c), {}).setdefault(mode, []).append(merged)
                    print(f"repeat {rep} c={c} {method}: " + ", ".join(
                        f"{mode} {tokens(merge(p)) / merge(p)['wall']:.1f} tok/s" for mode, p in runs.items()),
                          flush=True)
    write_report(args, cells, mismatches)


def merge(parts: list[dict]) -> dict:
    """Several sequential runs of one cell as one: walls and profiles add up."""
    seconds, depths = Counter(), Counter()
    for p in parts:
        seconds.update(p["profile"]["seconds"])
        depths.update({int(k): v for k, v in p["profile"]["depths"].items()})
    return {"wall": sum(p["wall"] for p in parts), "outputs": [o for p in parts for o in p["outputs"]],
            "stats": [s for p in parts for s in p["stats"]],
            "profile": {"steps": sum(p["profile"]["steps"] for p in parts), "seconds": dict(seconds),
                        "depths": dict(depths)}}


def tokens(run: dict) -> int:
    return sum(len(o) for o in run["outputs"])


def write_report(args, cells: dict, mismatches: Counter) -> None:
    med = statistics.median
    rows, lines = [], ["| method | c | in-process tok/s | decoupled tok/s | overlap tok/s | decoupled / in-process | "
                       "overlap / in-process | overlap / decoupled | overlap ratio | pre-drafted trees |",
                       "|---|---|---|---|---|---|---|---|---|---|"]
    for (method, c), modes in cells.items():
        tok_s = {m: [tokens(r) / r["wall"] for r in runs] for m, runs in modes.items()}
        ratio = {name: [a / b for a, b in zip(tok_s[x], tok_s[y])] for name, x, y in
                 (("dec", "decoupled", "in-process"), ("ovl", "overlap", "in-process"),
                  ("gain", "overlap", "decoupled"))}
        figures = [overlap_figures(r["profile"], r["stats"]) for r in modes["overlap"]]
        rows.append({"method": method, "concurrency": c, "tok_s": {m: med(v) for m, v in tok_s.items()},
                     "ratios": ratio, "overlap": figures})
        cell = " | ".join(f"{med(v):.3f} ({min(v):.3f}–{max(v):.3f})" for v in ratio.values())
        lines.append(f"| {method} | {c} | {med(tok_s['in-process']):.1f} | {med(tok_s['decoupled']):.1f} | "
                     f"{med(tok_s['overlap']):.1f} | {cell} | {med(f['overlap_ratio'] for f in figures):.2f} | "
                     f"{med(f['predraft_use'] for f in figures):.0%} |")
    differ = ", ".join(f"{cell}: {n}" for cell, n in mismatches.items() if n) or "none"
    md = "\n".join(lines) + f"\n\nGreedy outputs that differ from in-process, by cell (every repeat, warm-up " \
                             f"included): {differ}.\n"
    md += "\n" + model_check(cells)
    if args.breakdown:
        md += "\nms per engine step by span (median over repeats):\n\n" + breakdown_table(
            {f"{mode} {method} c={c}": runs for (method, c), modes in cells.items() for mode, runs in modes.items()})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_decoupled.json").write_text(json.dumps(
        {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "rows": rows,
         "mismatches": dict(mismatches),
         "profiles": {f"{mode} {m} c={c}": [r["profile"] for r in runs] for (m, c), modes in cells.items()
                      for mode, runs in modes.items()},
        "stats": {f"{mode} {m} c={c}": [r["stats"] for r in runs] for (m, c), modes in cells.items()
                  for mode, runs in modes.items()}}, indent=1))
    (args.out / "bench_decoupled.md").write_text(md)
    plot(rows, args.out / "decoupled.png")
    print(md)


if __name__ == "__main__":
    main()
