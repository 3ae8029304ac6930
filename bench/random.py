"""`sd` vs `ar` on tiny random Qwen3 pairs (no trained weights): the engine's overhead and τ in isolation.

    evospec bench random [--vocab 32000] [--repeats 3]
The draft is the target's first layer plus noise, so τ here says nothing about real models; it checks that the
speculative loop turns acceptance into speed, and that greedy outputs are identical.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from evospec.bench.harness import Arm, run_side_by_side, write_results
from evospec.config import SamplingParams, SpecParams, TreeParams
from evospec.engine.generate import SpeculativeDecoder
from evospec.testing import random_pair


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--target-layers", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("results/bench_random"))
    args = ap.parse_args(argv)
    target, draft = random_pair(vocab=args.vocab, seed=0, eos=-1, noise=0.2, hidden=args.hidden,
                                target_layers=args.target_layers)
    decoder = SpeculativeDecoder(target, draft)
    prompts = {"random": [[(31 * i + 7 * j) % args.vocab for j in range(12)] for i in range(4)]}
    arms = [Arm("ar", SpecParams(method="ar")),
            Arm("sd-chain4", SpecParams(method="sd", tree=TreeParams(shape="chain", num_draft_tokens=4))),
            Arm("sd-tree8", SpecParams(method="sd", tree=TreeParams(shape="tree", depth=4, branching=2, budget=8)))]
    samplings = {"greedy": SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
                 "T=1": SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=0, ignore_eos=True)}
    results = run_side_by_side(decoder, arms, prompts, samplings, args.repeats)
    write_results(results, {"suite": "random", **vars(args), "out": str(args.out)}, args.out, "bench_random")


if __name__ == "__main__":
    main()
