"""Benchmark v1: `ar`, `sd`, `frspec` K in {8k, 16k, 32k} and HF transformers assisted generation, side by side.

    evospec bench v1 [--repeats 3] [--prompts 6] [--max-tokens 64] [--out results/bench_v1]
"""
from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch

from evospec.bench.harness import Arm, run_side_by_side, write_results
from evospec.bench.prompts import PROMPT_SETS
from evospec.config import SamplingParams, SpecParams, TreeParams
from evospec.loading import load_pair
from evospec.tokenizer import chat_prompt_ids


def load_hf_models(target_dir: Path, draft_dir: Path | None, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).eval() if draft_dir else None
    return target, draft


def hf_arm(name: str, target, draft, stop_ids: tuple[int, ...]) -> Arm:
    def run(prompt: list[int], sampling: SamplingParams):
        kwargs = dict(do_sample=False) if sampling.greedy else dict(do_sample=True, temperature=sampling.temperature,
                                                                    top_p=sampling.top_p)
        if draft is not None:
            kwargs["assistant_model"] = draft
        with torch.inference_mode():
            out = target.generate(torch.tensor([prompt]), max_new_tokens=sampling.max_tokens,
                                  eos_token_id=list(stop_ids), pad_token_id=stop_ids[-1], **kwargs)
        tokens = out[0, len(prompt):].tolist()
        for i, t in enumerate(tokens):
            if t in stop_ids:
                return tokens[:i], None
        return tokens, None
    return Arm(name, run=run)


def hf_assisted_arm(draft_dir: Path, target_dir: Path, stop_ids: tuple[int, ...],
                    dtype: torch.dtype = torch.float32) -> Arm:
    """transformers' assisted generation (`assistant_model=`) on the same weights: the external peer."""
    target, draft = load_hf_models(target_dir, draft_dir, dtype)
    return hf_arm("hf-assisted", target, draft, stop_ids)


def tokenize_sets(tokenizer, names: list[str], n: int) -> dict[str, list[list[int]]]:
    return {name: [chat_prompt_ids(tokenizer, conv) for conv in PROMPT_SETS[name](n)] for name in names}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tree", default="chain", choices=["chain", "tree"])
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers assisted-generation peer")
    ap.add_argument("--out", type=Path, default=Path("results/bench_v1"))
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    pair = load_pair()
    tree = TreeParams(shape=args.tree, num_draft_tokens=args.num_draft_tokens, depth=4, branching=2, budget=8)
    arms = [Arm("ar", SpecParams(method="ar")), Arm("sd", SpecParams(method="sd", tree=tree))]
    arms += [Arm(f"frspec-{k // 1024}k", SpecParams(method="frspec", tree=tree, vocab={"static_size": k}))
             for k in (8192, 16384, 32768)]
    if not args.no_hf:
        arms.append(hf_assisted_arm(pair.draft_path, pair.target_path, pair.stop_ids))
    sets = tokenize_sets(pair.tokenizer, ["medical", "general"], args.prompts)
    samplings = {"greedy": SamplingParams(max_tokens=args.max_tokens, temperature=0.0),
                 "T=1": SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=0)}
    results = run_side_by_side(pair.decoder, arms, sets, samplings, args.repeats)
    meta = {"suite": "v1", "pair": "embedded tiny Qwen3 pair", "tree": tree.model_dump(), "repeats": args.repeats,
            "prompts_per_set": args.prompts, "max_tokens": args.max_tokens, "threads": torch.get_num_threads(),
            "machine": platform.platform(), "static_vocab": "Spec-Bench (general) 32k artifact, prefixes for 8k/16k"}
    write_results(results, meta, args.out, "bench_v1")


if __name__ == "__main__":
    main()
