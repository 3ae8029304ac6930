"""The EvoSpec table on our pair: ar, sd, frspec K, evospec K x Dyna, plus retrieval ablations, side by side.

    evospec bench grid [--repeats 3] [--prompts 4] [--max-tokens 48] [--out results/bench_grid]

Protocol: see bench/README.md (data, temperature, tree shape, repeats, and where we differ from the paper).
"""
from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch

from evospec.bench.harness import Arm, markdown_table, run_side_by_side, write_results
from evospec.bench.v1 import tokenize_sets
from evospec.config import SamplingParams, SpecParams, TreeParams
from evospec.loading import load_pair

STATIC_SIZES = (8192, 16384, 32768)
DYNAMIC_SIZES = (256, 512, 1024)
ABLATIONS = {"stat": ("statistical",), "sem": ("semantic",), "target": ("target",)}


def grid_arms(tree: TreeParams, full: bool) -> list[Arm]:
    arms = [Arm("ar", SpecParams(method="ar")), Arm("sd", SpecParams(method="sd", tree=tree))]
    statics = STATIC_SIZES if full else (32768,)
    dynamics = DYNAMIC_SIZES if full else (256,)
    for k in statics:
        arms.append(Arm(f"frspec-{k // 1024}k", SpecParams(method="frspec", tree=tree, vocab={"static_size": k})))
    for k in statics:
        for d in dynamics:
            arms.append(Arm(f"evospec-{k // 1024}k+{d}", SpecParams(
                method="evospec", tree=tree, vocab={"static_size": k, "dynamic_size": d})))
    for name, sources in ABLATIONS.items():
        arms.append(Arm(f"evospec-32k+256-{name}", SpecParams(
            method="evospec", tree=tree, vocab={"static_size": 32768, "dynamic_size": 256, "retrieval": sources})))
    return arms


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--sets", nargs="+", default=["medical", "general", "topic-switch"])
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.0])
    ap.add_argument("--small", action="store_true", help="only K=32k and Dyna=256 (quick look)")
    ap.add_argument("--tree", default="chain", choices=["chain", "tree"])
    ap.add_argument("--out", type=Path, default=Path("results/bench_grid"))
    args = ap.parse_args(argv)
    pair = load_pair()
    tree = TreeParams(shape=args.tree, num_draft_tokens=4, depth=4, branching=2, budget=8)
    arms = grid_arms(tree, full=not args.small)
    sets = tokenize_sets(pair.tokenizer, args.sets, args.prompts)
    samplings = {("greedy" if t == 0 else f"T={t}"): SamplingParams(max_tokens=args.max_tokens, temperature=t, seed=0)
                 for t in args.temperatures}
    results = run_side_by_side(pair.decoder, arms, sets, samplings, args.repeats)
    meta = {"suite": "grid", "pair": "embedded tiny Qwen3 pair", "tree": tree.model_dump(), "repeats": args.repeats,
            "prompts_per_set": args.prompts, "max_tokens": args.max_tokens, "threads": torch.get_num_threads(),
            "machine": platform.platform()}
    write_results(results, meta, args.out, "bench_grid")
    columns = ("tokens_per_s", "speedup_vs_ar", "tau", "miss_rate", "buffer_churn", "update_ms_per_step",
               "greedy_identical_to_ar")
    (args.out / "bench_grid.md").write_text((args.out / "bench_grid.md").read_text().split("\n###")[0]
                                            + markdown_table(results, columns))


if __name__ == "__main__":
    main()
