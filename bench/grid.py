"""The EvoSpec table: static K x Dyna (Dyna 0 = FR-Spec), plus `sd` and `ar`, side by side in one process; optionally
the same methods through the decoupled service (Ray Serve + gRPC) interleaved with them.

    evospec bench grid --pair qwen2.5-coder [--sets medical code general topic-switch] [--temperatures 0 1]
                       [--statics 8192 16384 32768] [--dynamics 0 256 512 1024] [--decoupled ar frspec-32k ...]

Besides tok/s and τ it reports, per arm: misses (target tokens outside A), the share of the target's tokens outside S
that the buffer recovered and each retrieval source's share of those hits, the buffer update's time on the draft's
critical path, and τ in the first 32 tokens of an answer vs after them (topic-switch: how fast D adapts). Before
the runs it measures the draft head (one pruned-logits call) and the buffer update (computed inline vs applied one
step later) per K and Dyna. Writes bench_grid.{json,md,png} (per set bars) and bench_grid_heatmap.png (K x Dyna).

Protocol: bench/README.md (data, temperature, tree shape, repeats, and where we differ from the paper).
"""
from __future__ import annotations

import argparse
import platform
import resource
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from evospec.bench.harness import Arm, markdown_table, run_ms, run_side_by_side, write_results
from evospec.bench.v1 import tokenize_sets
from evospec.config import SamplingParams, SpecParams, TreeParams
from evospec.datasets import split_pubmedqa
from evospec.engine.generate import SpeculativeDecoder
from evospec.engine.stats import SpecStats
from evospec.kernels.pruned_head import pruned_logits
from evospec.loading import LoadedPair, load_named_pair
from evospec.modelstore.catalog import TINY, pair_names
from evospec.verify import VerifyResult
from evospec.vocab.active import full_vocab, static_vocab
from evospec.vocab.policy import EvoSpecPolicy
from evospec.vocab.retrieval import target_feedback

STATIC_SIZES = (8192, 16384, 32768)
DYNAMIC_SIZES = (0, 256, 512, 1024)  # 0 = frspec
ABLATIONS = {"stat": ("statistical",), "sem": ("semantic",), "target": ("target",)}
COLUMNS = ("tokens_per_s", "speedup_vs_ar", "tau", "miss_rate", "recovered", "hits_statistical", "hits_semantic",
           "hits_target", "update_ms_per_step", "tau_first32", "tau_after32", "greedy_identical_to_ar")


def arm_name(static: int, dynamic: int) -> str:
    return f"frspec-{static // 1024}k" if dynamic == 0 else f"evospec-{static // 1024}k+{dynamic}"


def grid_arms(tree: TreeParams, statics, dynamics, ablations: bool) -> list[Arm]:
    arms = [Arm("ar", SpecParams(method="ar")), Arm("sd", SpecParams(method="sd", tree=tree))]
    for k in statics:
        for d in dynamics:
            method = "frspec" if d == 0 else "evospec"
            arms.append(Arm(arm_name(k, d), SpecParams(method=method, tree=tree,
                                                       vocab={"static_size": k, "dynamic_size": d})))
    if ablations:  # one retrieval source at a time, at the largest K and smallest Dyna > 0 of the grid
        k, d = max(statics), min(x for x in dynamics if x) if any(dynamics) else 256
        for name, sources in ABLATIONS.items():
            arms.append(Arm(f"{arm_name(k, d)}-{name}", SpecParams(
                method="evospec", tree=tree, vocab={"static_size": k, "dynamic_size": d, "retrieval": sources})))
    return arms


def inline_arm(pair: LoadedPair, tree: TreeParams, static: int, dynamic: int) -> Arm:
    """The same EvoSpec configuration with its buffer update computed and applied inline (update_lag 0)."""
    dec = pair.decoder
    inline = SpeculativeDecoder(dec.target.model, dec.draft.model, static_ids=dec.policies.static_ids,
                                eos_ids=pair.stop_ids, cooc=dec.policies.cooc)
    inline.policies = dec.policies.with_evospec(replace(dec.policies.evospec, update_lag=0))
    return Arm(f"{arm_name(static, dynamic)}/inline", SpecParams(
        method="evospec", tree=tree, vocab={"static_size": static, "dynamic_size": dynamic}), decoder=inline)


def service_arm(client, arm: Arm) -> Arm:
    """`arm`'s method through the decoupled service: same prompt ids, sampling and speculation."""
    spec = arm.spec

    def run(prompt: list[int], sampling: SamplingParams):
        out = client.generate(prompt_token_ids=prompt, max_tokens=sampling.max_tokens,
                              temperature=sampling.temperature, seed=sampling.seed, method=spec.method,
                              tree=spec.tree.model_dump(), static_size=spec.vocab.static_size,
                              dynamic_size=spec.vocab.dynamic_size, retrieval=list(spec.vocab.retrieval))
        stats = SpecStats(**{k: v for k, v in out.stats.items() if k in SpecStats.__dataclass_fields__})
        return list(out.token_ids), stats
    return Arm(f"{arm.name}/service", run=run)


def median_ms(fn, repeats: int = 30) -> float:
    return round(statistics.median(run_ms(fn, repeats)), 3)


def head_costs(weight: torch.Tensor, static_ids: torch.Tensor, statics, dynamics, rows=(1, 4)) -> dict:
    """Median ms of the draft head (logits over A for n hidden rows): full vocabulary, S only, S + Dyna."""
    weight = weight.detach()
    out = {}
    for n in rows:
        hidden = torch.randn(n, weight.shape[1], dtype=weight.dtype, device=weight.device)
        costs = {"full": median_ms(lambda: full_vocab(weight).logits(hidden))}
        for k in statics:
            static = static_vocab(weight, static_ids[:k])
            costs[f"{k // 1024}k"] = median_ms(lambda: pruned_logits(hidden, static.static_rows))
            for d in dynamics:
                if d:
                    active = static.with_dynamic_slots(weight, d)
                    last_ids = list(range(weight.shape[0] - d, weight.shape[0]))
                    active.set_dynamic_many(weight, list(range(d)), last_ids, [0.0] * d)
                    costs[f"{k // 1024}k+{d}"] = median_ms(lambda: active.logits(hidden))
        out[f"rows={n}"] = costs
    return out


def update_costs(pair: LoadedPair, prompt: list[int], answer: list[int], statics, dynamics,
                 step_s: float) -> dict:
    """Per-step buffer update (Dyna 256 and 1024 at the two largest K) on the draft's critical path: median / mean /
    max ms over an answer replayed 3 tokens per step, with target-fed candidates from random logits peaked at the
    committed tokens; computed inline (update_lag 0) vs applied one step later (update_lag 1: the worker runs while
    `step_s` of drafting and verification would); and the target side's feedback (misses + candidates)."""
    dec = pair.decoder
    weight = dec.draft.model.head_weight.detach()
    vocab = dec.target.vocab_size
    out = {}
    for k in sorted(statics)[-2:]:
        for d in (d for d in dynamics if d in (256, 1024)):
            row = {}
            shared = dec.policies.get(SpecParams(method="evospec", vocab={"static_size": k, "dynamic_size": d}))
            for lag in (0, 1):
                policy = EvoSpecPolicy(weight, dec.policies.static_ids[:k], replace(shared.settings, update_lag=lag),
                                       dec.policies.cooc, shared.index, shared.worker)
                session = policy.new_session(prompt)
                on_path, feedback_s = [], []
                for i in range(0, len(answer) - 2, 3):
                    tokens = answer[i:i + 3]
                    logits = torch.randn(3, vocab)
                    logits[torch.arange(3), torch.tensor(tokens)] += 20
                    start = time.perf_counter()
                    fb = target_feedback(logits, tokens, session.in_active())
                    mid = time.perf_counter()
                    session.observe(VerifyResult([0, 1], tokens[:2], tokens[2]), fb)
                    on_path.append(time.perf_counter() - mid)
                    feedback_s.append(mid - start)
                    time.sleep(step_s)
                session.close()
                row[f"lag{lag}"] = {"median_ms": round(1000 * statistics.median(on_path), 3),
                                    "mean_ms": round(1000 * statistics.mean(on_path), 3),
                                    "max_ms": round(1000 * max(on_path), 3),
                                    "target_feedback_median_ms": round(1000 * statistics.median(feedback_s), 3)}
            out[arm_name(k, d)] = row
    return out


# The paper's medicine table (tok/s, co-located Qwen3 pair on a GPU): only ratios compare across machines.
PAPER_TOK_S = {"evospec-32k+256": 128.51, "evospec-16k+1024": 122.88, "evospec-8k+1024": 108.75,
               "frspec-32k": 114.08, "sd": 111.93}


def paper_table(results: dict, key: str) -> str:
    """One (set, temperature) as the paper's table: tok/s and ratios to `ar` and to `frspec-32k` (the paper's
    baseline), next to the paper's ratio to FR-Spec 32k where it has the arm; then τ, misses and what D recovered."""
    row = results[key]
    base = row.get("frspec-32k", {}).get("tokens_per_s", {}).get("median")
    lines = [f"| {key} | tok/s | × ar | × frspec-32k | paper × FR-Spec 32k | τ | miss rate | recovered "
             "(stat / sem / target) |", "|---" * 8 + "|"]
    for name, entry in row.items():
        tps = entry["tokens_per_s"]
        paper = f"{PAPER_TOK_S[name] / PAPER_TOK_S['frspec-32k']:.3f}" if name in PAPER_TOK_S else ""
        ratio = f"{tps['median'] / base:.3f}" if base else ""
        tau = entry.get("tau", {})
        vocab = ""
        if entry.get("recovered", {}).get("median"):
            vocab = (f"{entry['recovered']['median']:.2f} ({entry['hits_statistical']['median']:.2f} / "
                     f"{entry['hits_semantic']['median']:.2f} / {entry['hits_target']['median']:.2f})")
        miss = entry.get("miss_rate", {}).get("median")
        lines.append(f"| {name} | {tps['median']:.2f} ({tps['min']:.2f}–{tps['max']:.2f}) | "
                     f"{entry.get('speedup_vs_ar', '')} | {ratio} | {paper} | "
                     f"{tau.get('median', '')} | {'' if miss is None else f'{miss:.3f}'} | {vocab} |")
    return "\n".join(lines) + "\n"


def plot_heatmap(results: dict, statics, dynamics, path: Path) -> None:
    """One panel per (set, temperature): K x Dyna cells coloured by tok/s relative to `ar` (the paper's speedup),
    annotated with that ratio and τ; the title gives `sd`'s."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = list(results)
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        row = results[key]
        grid = [[row.get(arm_name(k, d), {}).get("speedup_vs_ar", float("nan")) for d in dynamics] for k in statics]
        ax.imshow(grid, cmap="viridis", aspect="auto")
        for i, k in enumerate(statics):
            for j, d in enumerate(dynamics):
                entry = row.get(arm_name(k, d), {})
                if entry:
                    ax.text(j, i, f"{entry['speedup_vs_ar']:.2f}x\nτ {entry['tau']['median']:.2f}", ha="center",
                            va="center", fontsize=7, color="white")
        ax.set_xticks(range(len(dynamics)), [str(d) for d in dynamics])
        ax.set_yticks(range(len(statics)), [f"{k // 1024}k" for k in statics])
        ax.set_xlabel("Dyna (0 = frspec)")
        ax.set_ylabel("static K")
        sd = row.get("sd", {}).get("speedup_vs_ar")
        ax.set_title(f"{key}" + (f" (sd {sd:.2f}x)" if sd else ""), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default=TINY, choices=pair_names())
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="target, real pairs (auto: bf16 only where the CPU has it natively)")
    ap.add_argument("--draft-quantize", default="int8", choices=["int8", "none"], help="draft layers, real pairs")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (this machine has 2 cores)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per set")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--sets", nargs="+", default=["medical", "code", "general", "topic-switch"])
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    ap.add_argument("--statics", nargs="+", type=int, default=list(STATIC_SIZES))
    ap.add_argument("--dynamics", nargs="+", type=int, default=list(DYNAMIC_SIZES), help="0 = frspec")
    ap.add_argument("--no-sd", action="store_true")
    ap.add_argument("--only", nargs="+", metavar="ARM", help="keep only these arms of the grid (e.g. the goals' arms)")
    ap.add_argument("--ablations", action="store_true", help="one retrieval source at a time (largest K)")
    ap.add_argument("--inline", action="store_true",
                    help="also evospec at the largest K and smallest Dyna with its buffer update inline")
    ap.add_argument("--decoupled", nargs="*", default=[], metavar="ARM",
                    help="arms (by name, e.g. ar frspec-32k evospec-32k+256) also run through the decoupled service "
                         "(the pair's service config), interleaved with the in-process arms")
    ap.add_argument("--service-adaptive", action="store_true",
                    help="let the service's scheduler choose each step's draft depth (default: full trees, as the "
                         "in-process arms draft)")
    ap.add_argument("--tree", default="chain", choices=["chain", "tree"])
    ap.add_argument("--no-costs", action="store_true", help="skip the head and update-time measurements")
    ap.add_argument("--out", type=Path, default=Path("results/bench_grid"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tree = TreeParams(shape=args.tree, num_draft_tokens=4, depth=4, branching=2, budget=8)
    pair = load_named_pair(args.pair) if args.pair == TINY else \
        load_named_pair(args.pair, dtype=args.dtype, draft_quantize=args.draft_quantize)
    arms = grid_arms(tree, args.statics, args.dynamics, args.ablations)
    if args.no_sd:
        arms = [a for a in arms if a.name != "sd"]
    if args.only:
        unknown = set(args.only) - {a.name for a in arms}
        if unknown:
            raise SystemExit(f"--only: no arms {sorted(unknown)} in this grid; it has {[a.name for a in arms]}")
        arms = [a for a in arms if a.name in args.only]
    if args.inline and any(args.dynamics):
        arms.append(inline_arm(pair, tree, max(args.statics), min(d for d in args.dynamics if d)))
    sets = tokenize_sets(pair.tokenizer, args.sets, args.prompts)
    samplings = {("greedy" if t == 0 else f"T={t:g}"): SamplingParams(max_tokens=args.max_tokens, temperature=t,
                                                                      seed=None if t == 0 else 0)
                 for t in args.temperatures}
    meta = {"suite": "grid", "pair": args.pair, "dtype": args.dtype, "draft_quantize": args.draft_quantize,
            "tree": tree.model_dump(), "repeats": args.repeats, "prompts_per_set": args.prompts,
            "max_tokens": args.max_tokens, "threads": torch.get_num_threads(), "machine": platform.platform(),
            "static_vocab": pair.static_vocab, "evospec_settings": vars(pair.decoder.policies.evospec)}
    if not args.no_costs:
        prompt = tokenize_sets(pair.tokenizer, ["medical"], 1)["medical"][0]
        answer = pair.tokenizer(" ".join(split_pubmedqa()[1][0]["contexts"]))["input_ids"][:300]  # its abstract
        meta["head_ms"] = head_costs(pair.decoder.draft.model.head_weight, pair.decoder.policies.static_ids,
                                     args.statics, args.dynamics)
        meta["update_ms"] = update_costs(pair, prompt, answer, args.statics, args.dynamics,
                                         step_s=0.1 if args.pair != TINY else 0.01)
    if args.decoupled:
        run_with_service(args, pair, arms, sets, samplings, meta)
    else:
        results = run_side_by_side(pair.decoder, arms, sets, samplings, args.repeats)
        finish(args, results, meta)


def run_with_service(args, pair: LoadedPair, arms: list[Arm], sets, samplings, meta: dict) -> None:
    from evospec.orchestration.config import AppConfig, config_for_pair
    from evospec.orchestration.local import free_port, local_service
    from evospec_client import EvoSpecClient
    by_name = {a.name: a for a in arms}
    unknown = [n for n in args.decoupled if n not in by_name or by_name[n].spec is None or by_name[n].decoder]
    if unknown:
        raise SystemExit(f"--decoupled: unknown arms {unknown}; choose among {[a.name for a in arms if a.spec]}")
    cfg = AppConfig.from_yaml(config_for_pair(args.pair))
    scheduler = cfg.target.scheduler.model_copy(update={"adaptive": args.service_adaptive})
    cfg = cfg.model_copy(update={"grpc_port": free_port(), "http_port": free_port(),
                                 "target": cfg.target.model_copy(update={"scheduler": scheduler})})
    meta["service_config"] = str(config_for_pair(args.pair))
    meta["service_adaptive_depth"] = args.service_adaptive
    with local_service(cfg) as address, EvoSpecClient(address, timeout=600) as client:
        client.wait_ready(timeout=600)
        arms = arms + [service_arm(client, by_name[n]) for n in args.decoupled]
        results = run_side_by_side(pair.decoder, arms, sets, samplings, args.repeats)
    finish(args, results, meta)


def finish(args, results: dict, meta: dict) -> None:
    meta["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    write_results(results, meta, args.out, "bench_grid")
    (args.out / "bench_grid.md").write_text((args.out / "bench_grid.md").read_text().split("\n###")[0]
                                            + markdown_table(results, COLUMNS))
    plot_heatmap(results, args.statics, args.dynamics, args.out / "bench_grid_heatmap.png")
    paper = "\n".join(paper_table(results, key) for key in results)
    (args.out / "bench_grid_paper.md").write_text(paper)
    print(paper)


if __name__ == "__main__":
    main()
