"""Benchmark on a real pretrained pair (default: Qwen2.5-Coder 0.5B -> 1.5B, `evospec models fetch qwen2.5-coder`),
side by side in one process: transformers `generate` and assisted generation on the same weights and dtype, our
`ar`, `sd`, `frspec` 16k/32k and `evospec` 32k+256 / 16k+1024, chain and tree shapes; medical (held-out PubMedQA)
and general (Spec-Bench) prompts; greedy and T=1.

    evospec bench real [--repeats 3] [--prompts 2] [--max-tokens 48] [--dtype auto] [--threads 2]

Our draft runs int8 decoder layers by default (`--draft-quantize`; lossless either way: the target verifies), and one
arm repeats frspec-32k with the unquantized draft that HF assisted generation uses. Also measured and recorded: one
forward of n = 1..16 new tokens of each model in float32 and bfloat16 (the cost curve a tree shape trades against),
and the peak RSS of the process.
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
from pathlib import Path

import torch

from evospec.bench.harness import Arm, run_side_by_side, write_results
from evospec.bench.v1 import hf_arm, load_hf_models, tokenize_sets
from evospec.config import SamplingParams, SpecParams, TreeParams
from evospec.engine.generate import SpeculativeDecoder
from evospec.loading import LoadedPair, load_named_pair, load_qwen3_folder, named_pair_folders, resolve_dtype
from evospec.model.qwen3 import forward_seconds

CHAIN = TreeParams(shape="chain", num_draft_tokens=4)
TREE = TreeParams(shape="tree", depth=4, branching=2, budget=8)


def speculative_arms(shapes: list[str]) -> list[Arm]:
    """Every method on chains; the tree shape for sd, frspec 32k and evospec 32k+256 (the ones it can change most)."""
    arms = [Arm("ar", SpecParams(method="ar"))]
    if "chain" in shapes:
        arms += [Arm("sd", SpecParams(method="sd", tree=CHAIN)),
                 Arm("frspec-16k", SpecParams(method="frspec", tree=CHAIN, vocab={"static_size": 16384})),
                 Arm("frspec-32k", SpecParams(method="frspec", tree=CHAIN, vocab={"static_size": 32768})),
                 Arm("evospec-32k+256", SpecParams(method="evospec", tree=CHAIN,
                                                   vocab={"static_size": 32768, "dynamic_size": 256})),
                 Arm("evospec-16k+1024", SpecParams(method="evospec", tree=CHAIN,
                                                    vocab={"static_size": 16384, "dynamic_size": 1024}))]
    if "tree" in shapes:
        arms += [Arm("sd-tree", SpecParams(method="sd", tree=TREE)),
                 Arm("frspec-32k-tree", SpecParams(method="frspec", tree=TREE, vocab={"static_size": 32768})),
                 Arm("evospec-32k+256-tree", SpecParams(method="evospec", tree=TREE,
                                                        vocab={"static_size": 32768, "dynamic_size": 256}))]
    return arms


VARIANTS = {"bfloat16": ("bfloat16", "none"), "float32": ("float32", "none"), "int8": ("float32", "int8")}


def forward_costs(folder: Path, variants: list[str], sizes=(1, 2, 4, 8, 16), repeats: int = 5) -> dict:
    """Median ms of one forward (full LM head included) of n new tokens after a 64-token context, per weight
    variant (VARIANTS): measured, not assumed."""
    out = {}
    for name in variants:
        dtype, quantize = VARIANTS[name]
        model = load_qwen3_folder(folder, dtype, quantize=quantize)
        cost = forward_seconds(model, sizes, context=64, repeats=repeats, with_head=True)
        out[name] = {n: round(1000 * s, 2) for n, s in cost.items()}
        del model
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="qwen2.5-coder")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per set")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="target (and HF peers; auto: bf16 only where the CPU has it natively)")
    ap.add_argument("--draft-quantize", default="int8", choices=["int8", "none"],
                    help="our draft: int8 decoder layers (default, measured faster on CPU) or the --dtype weights; "
                         "with int8, `frspec-32k/draft-<dtype>` repeats frspec-32k with the unquantized draft")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (this machine has 2 cores)")
    ap.add_argument("--shapes", nargs="+", default=["chain", "tree"], choices=["chain", "tree"])
    ap.add_argument("--sets", nargs="+", default=["medical", "general"])
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers peers")
    ap.add_argument("--skip", nargs="*", default=[], help="arm names to leave out (e.g. sd-tree)")
    ap.add_argument("--no-kernels", action="store_true", help="skip the forward-cost measurement")
    ap.add_argument("--kernels-only", action="store_true",
                    help="only the forward-cost measurement (e.g. to compare --threads 1 and 2)")
    ap.add_argument("--out", type=Path, default=Path("results/bench_real"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    folders = named_pair_folders(args.pair)  # the cost curve needs no loaded pair
    costs = {} if args.no_kernels else {
        "target": forward_costs(folders["target"], ["bfloat16", "float32"]),
        "draft": forward_costs(folders["draft"], ["bfloat16", "float32", "int8"])}
    if args.kernels_only:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"forward_costs_threads{torch.get_num_threads()}.json"
        path.write_text(json.dumps({"threads": torch.get_num_threads(), "forward_ms_by_new_tokens": costs}, indent=1))
        print(json.dumps(costs, indent=1))
        return
    args.dtype = str(resolve_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")  # recorded as chosen
    pair: LoadedPair = load_named_pair(args.pair, dtype=args.dtype, draft_quantize=args.draft_quantize)
    arms = speculative_arms(args.shapes)
    if args.draft_quantize == "int8":  # the same method with the draft HF assisted generation uses
        plain = SpeculativeDecoder(pair.decoder.target.model, load_qwen3_folder(pair.draft_path, args.dtype),
                                   static_ids=pair.decoder.policies.static_ids, eos_ids=pair.stop_ids,
                                   cooc=pair.decoder.policies.cooc)
        arms.append(Arm(f"frspec-32k/draft-{args.dtype}", SpecParams(method="frspec", tree=CHAIN), decoder=plain))
    if not args.no_hf:
        hf_target, hf_draft = load_hf_models(pair.target_path, pair.draft_path, getattr(torch, args.dtype))
        arms = [hf_arm("hf-generate", hf_target, None, pair.stop_ids),
                hf_arm("hf-assisted", hf_target, hf_draft, pair.stop_ids)] + arms
    arms = [a for a in arms if a.name not in args.skip]
    sets = tokenize_sets(pair.tokenizer, args.sets, args.prompts)
    samplings = {("greedy" if t == 0 else f"T={t:g}"): SamplingParams(max_tokens=args.max_tokens, temperature=t,
                                                                      seed=None if t == 0 else 0)
                 for t in args.temperatures}
    results = run_side_by_side(pair.decoder, arms, sets, samplings, args.repeats)
    meta = {"suite": "real", "pair": args.pair, "draft": str(pair.draft_path), "target": str(pair.target_path),
            "dtype": args.dtype, "draft_quantize": args.draft_quantize, "threads": torch.get_num_threads(),
            "repeats": args.repeats,
            "prompts_per_set": args.prompts, "max_tokens": args.max_tokens,
            "chain": CHAIN.model_dump(), "tree": TREE.model_dump(),
            "forward_ms_by_new_tokens": costs,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "machine": platform.platform(), "static_vocab": pair.static_vocab}
    write_results(results, meta, args.out, "bench_real")


if __name__ == "__main__":
    main()
