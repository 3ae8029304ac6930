"""Weight formats side by side on one machine: speed and quality of the target in each format `model.quantize` offers
(evospec/model/weight_formats.py), against the same model in float32.

    evospec bench formats                     # the real pair's target: float32, bf16 and every quantized format
    evospec bench formats --role draft --formats float32 none int8 int4-weight-only --prompts 4

Per format, in this process, one format loaded at a time (memory):
- **speed**: load seconds (with the conversion), one forward of n = 1/2/4/8 new tokens after a 300-token context
  with the full LM head (`forward_seconds`, best of 5), and `ar` decode tok/s over the greedy generations below;
- **greedy agreement with float32**: held-out-style prompts (medical-rag: a PubMedQA abstract and its question; code:
  a standard-library stub), `--tokens` greedy tokens each; per prompt the number of tokens until the first
  divergence from the float32 model's, and the share of prompts whose whole answer is identical;
- **perplexity** on held-out PubMedQA abstracts (`--ppl-docs` documents, up to 512 tokens each; float32 is the
  reference, a format's quality loss is its perplexity over float32's).

The model's float32 weights are themselves the dequantized Q4_K_M GGUF they were converted from (docs/models.md),
so "float32" here is the Q4_K_M model computed in float32 (from weights rounded to bf16 on conversion); the table
says how much each format adds to that. `gguf` holds the GGUF's own blocks, so its difference is the activations'
8-bit quantization alone (and the bf16 rounding the reference has and it has not). Writes
formats.json and formats.md to --out (default results/bench_formats), with the CPU and torch threads.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from evospec.datasets import code_stub_prompts, medical_rag_prompts, split_pubmedqa
from evospec.kernels.tree import chain_then_tree_mask
from evospec.loading import cpu_description, load_qwen3_folder, named_pair_folders, stop_token_ids
from evospec.model.qwen3 import Qwen3, forward_seconds
from evospec.tokenizer import chat_prompt_ids, load_tokenizer

FORMATS = ("float32", "none", "int8-weight-only", "int4-weight-only", "int8-per-token", "gguf")


def load_format(folder: Path, fmt: str) -> Qwen3:
    """`float32`: the dense model in float32 (the reference); otherwise `model.quantize: fmt` with `dtype: auto`."""
    if fmt == "float32":
        return load_qwen3_folder(folder, "float32", "cpu", "none")
    return load_qwen3_folder(folder, "float32" if fmt == "int8" else "auto", "cpu", fmt)


@torch.inference_mode()
def greedy(model: Qwen3, prompt: list[int], tokens: int, stop: set[int]) -> tuple[list[int], float]:
    """`ar` in one process: prefill, then one token per forward. Returns the tokens and the decode seconds."""
    cache = model.new_cache(len(prompt) + tokens + 2)
    n = len(prompt)
    hidden = model(torch.tensor(prompt), torch.arange(n), cache, chain_then_tree_mask(0, n, None))
    cache.advance(n)
    out = [int(model.full_logits(hidden[-1:]).argmax(-1))]
    start = time.perf_counter()
    while len(out) < tokens and out[-1] not in stop:
        hidden = model(torch.tensor(out[-1:]), torch.tensor([cache.length]), cache,
                       chain_then_tree_mask(cache.length, 1, None))
        cache.advance(1)
        out.append(int(model.full_logits(hidden).argmax(-1)))
    return out, time.perf_counter() - start


@torch.inference_mode()
def perplexity(model: Qwen3, docs: list[list[int]]) -> float:
    """exp of the mean next-token negative log-likelihood over every position of every document."""
    nll, count = 0.0, 0
    for ids in docs:
        n = len(ids)
        cache = model.new_cache(n)
        hidden = model(torch.tensor(ids), torch.arange(n), cache, chain_then_tree_mask(0, n, None))
        logp = torch.log_softmax(model.full_logits(hidden[:-1]), dim=-1)
        nll -= float(logp.gather(1, torch.tensor(ids[1:])[:, None]).sum())
        count += n - 1
    return math.exp(nll / count)


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first token where a and b differ (len of the shorter when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure(folder: Path, fmt: str, prompts: dict[str, list[list[int]]], docs: list[list[int]], tokens: int,
            stop: set[int]) -> dict:
    started = time.perf_counter()
    model = load_format(folder, fmt)
    row = {"format": fmt, "weights": model.weight_format, "dtype": str(model.embed_tokens.weight.dtype),
           "load_s": time.perf_counter() - started, "auto_measured_s": model.weight_format_seconds,
           "single_token_padding": model.pad_single_token}
    row["forward_ms"] = {n: s * 1e3 for n, s in forward_seconds(model, sizes=(1, 2, 4, 8), context=300, repeats=5,
                                                                 with_head=True).items()}
    answers, decode_s, decoded = {}, 0.0, 0
    for name, items in prompts.items():
        answers[name] = []
        for prompt in items:
            out, seconds = greedy(model, prompt, tokens, stop)
            answers[name].append(out)
            decode_s, decoded = decode_s + seconds, decoded + len(out) - 1
    row["decode_tok_s"] = decoded / decode_s
    row["answers"] = answers
    row["perplexity"] = perplexity(model, docs)
    return row


def add_agreement(rows: list[dict]) -> None:
    """Each row's greedy answers against the float32 row's: tokens to first divergence, share identical."""
    reference = next(r for r in rows if r["format"] == "float32")["answers"]
    for row in rows:
        firsts, same = [], 0
        for name, answers in row["answers"].items():
            for ours, ref in zip(answers, reference[name]):
                firsts.append(first_divergence(ours, ref))
                same += ours == ref
        row["identical_share"] = same / len(firsts)
        row["first_divergence"] = {"median": statistics.median(firsts), "min": min(firsts), "max": max(firsts)}


def markdown(report: dict) -> str:
    ref = next(r for r in report["rows"] if r["format"] == "float32")
    lines = [f"# Weight formats: {report['role']} of {report['pair']}", "",
             f"CPU: {report['cpu']}; torch threads {report['threads']}; {report['tokens']} greedy tokens per prompt, "
             f"{report['prompts']} prompts per set; perplexity over {report['ppl_docs']} held-out PubMedQA abstracts "
             f"({report['ppl_tokens']} tokens).", "",
             "| format | runs as | load s | forward ms 1 / 2 / 4 / 8 tokens | decode tok/s | perplexity (Δ vs fp32) | "
             "identical answers | tokens to 1st divergence median [min-max] |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        ms = " / ".join(f"{v:.0f}" for v in r["forward_ms"].values())
        d = r["first_divergence"]
        lines.append(f"| {r['format']} | {r['weights']} {r['dtype'].removeprefix('torch.')} | {r['load_s']:.1f} | "
                     f"{ms} | {r['decode_tok_s']:.2f} | {r['perplexity']:.3f} "
                     f"({100 * (r['perplexity'] / ref['perplexity'] - 1):+.2f}%) | {100 * r['identical_share']:.0f}% | "
                     f"{d['median']} [{d['min']}-{d['max']}] |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="evospec bench formats", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="qwen2.5-coder")
    ap.add_argument("--role", default="target", choices=["target", "draft"])
    ap.add_argument("--formats", nargs="+", default=list(FORMATS),
                    choices=["float32", "none", "int8", "int8-weight-only", "int4-weight-only", "int8-per-token", "gguf",
                             "auto"])
    ap.add_argument("--prompts", type=int, default=6, help="prompts per set (medical-rag, code)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ppl-docs", type=int, default=12)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default="results/bench_formats")
    args = ap.parse_args(argv)
    if "float32" not in args.formats:
        args.formats.insert(0, "float32")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = named_pair_folders(args.pair)[args.role]
    tokenizer = load_tokenizer(str(folder))
    prompts = {"medical-rag": [chat_prompt_ids(tokenizer, m) for m in medical_rag_prompts(args.prompts)],
               "code": [chat_prompt_ids(tokenizer, m) for m in code_stub_prompts(args.prompts)]}
    _, held = split_pubmedqa()
    docs = [tokenizer.encode(" ".join(item["contexts"]))[:512] for item in held[-args.ppl_docs:]]
    stop = set(stop_token_ids(folder))
    rows = []
    for fmt in args.formats:
        print(f"{fmt}: loading and measuring ...", flush=True)
        rows.append(measure(folder, fmt, prompts, docs, args.tokens, stop))
        print(f"{fmt}: {rows[-1]['weights']}, decode {rows[-1]['decode_tok_s']:.2f} tok/s, "
              f"perplexity {rows[-1]['perplexity']:.3f}", flush=True)
    add_agreement(rows)
    report = {"pair": args.pair, "role": args.role, "cpu": cpu_description(),
              "isa": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
              "tokens": args.tokens, "prompts": args.prompts, "ppl_docs": len(docs),
              "ppl_tokens": sum(len(d) for d in docs), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "formats.json").write_text(json.dumps(report, indent=1))
    (out / "formats.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
