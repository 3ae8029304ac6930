"""`evospec` command line: demo, serve, generate, vocab, bench, loadtest, train-tiny."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEMO_QUESTION = "Is a high body mass index associated with worse outcomes after surgery for colorectal cancer?"


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", help="draft HF folder (default: the embedded tiny pair)")
    p.add_argument("--target", help="target HF folder (default: the embedded tiny pair)")
    p.add_argument("--static-vocab", help="static vocabulary artifact (default: the committed Spec-Bench 32k)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])


def add_request_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=DEMO_QUESTION, help="user message (chat template applied)")
    p.add_argument("--method", default="evospec", choices=["ar", "sd", "frspec", "evospec"])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--tree", default="chain", choices=["chain", "tree"])
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--branching", type=int, default=2)
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--static-size", type=int, default=32768)
    p.add_argument("--dynamic-size", type=int, default=256)


def request_from_args(args) -> tuple:
    from evospec.config import SamplingParams, SpecParams, TreeParams, VocabParams, validated
    sampling = validated(SamplingParams, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                         top_k=args.top_k, seed=args.seed)
    tree = validated(TreeParams, shape=args.tree, num_draft_tokens=args.num_draft_tokens, depth=args.depth,
                     branching=args.branching, budget=args.budget)
    vocab = validated(VocabParams, static_size=args.static_size, dynamic_size=args.dynamic_size)
    return sampling, validated(SpecParams, method=args.method, tree=tree, vocab=vocab)


def cmd_demo_in_process(args) -> int:
    import time

    from evospec.loading import load_pair
    from evospec.report import print_stats
    from evospec.loading import DEFAULT_STATIC_VOCAB
    pair = load_pair(args.draft, args.target, args.static_vocab or DEFAULT_STATIC_VOCAB, args.device, args.dtype)
    sampling, spec = request_from_args(args)
    prompt_ids = pair.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                    add_generation_prompt=True, enable_thinking=False)
    print(f"[{spec.method}] {args.prompt}\n")
    start = time.perf_counter()
    gen = pair.decoder.generate(list(prompt_ids), sampling, spec)
    for chunk in gen:
        print(pair.tokenizer.decode(chunk.token_ids), end="", flush=True)
    elapsed = time.perf_counter() - start
    print(f"\n\n(finish: {gen.finish_reason})")
    stats = {"method": spec.method, **gen.stats.as_dict(),
             "tokens_per_second": round(gen.stats.generated_tokens / elapsed, 1)}
    print_stats(stats)
    return 0


def cmd_vocab(args) -> int:
    from evospec.tokenizer import load_tokenizer
    from evospec.vocab.static import (StaticVocab, build_static_vocab, export_sglang_token_map,
                                      import_sglang_token_map)
    if args.vocab_cmd == "build":
        tok = load_tokenizer(args.tokenizer)
        vocab = build_static_vocab(tok, [Path(p) for p in args.corpus], tuple(args.field), args.size)
        vocab.save(Path(args.out))
        print(f"wrote {args.out}: {len(vocab.token_ids)} ids from {vocab.meta['tokens_counted']:,} tokens "
              f"({vocab.meta['distinct_tokens_seen']:,} distinct)")
        for size in args.sglang_sizes or []:
            dst = Path(args.out).with_suffix(f".sglang-{size}.pt")
            export_sglang_token_map(vocab, dst, size)
            print(f"wrote {dst} (SGLang --speculative-token-map, {size} ids)")
    elif args.vocab_cmd == "export-sglang":
        export_sglang_token_map(StaticVocab.load(Path(args.artifact)), Path(args.out), args.size)
        print(f"wrote {args.out}")
    elif args.vocab_cmd == "cooc":
        from evospec.vocab.cooc import build_pubmedqa_cooc
        build_pubmedqa_cooc(Path(args.out), Path(args.static_vocab))
    elif args.vocab_cmd == "import-sglang":
        tok = load_tokenizer(args.tokenizer)
        vocab = import_sglang_token_map(Path(args.token_map), len(tok))
        vocab.save(Path(args.out))
        print(f"wrote {args.out}: {len(vocab.token_ids)} ids")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="evospec", description="EvoSpec Serve: decoupled speculative decoding")
    sub = ap.add_subparsers(dest="cmd", required=True)

    demo = sub.add_parser("demo", help="stream a medical answer with speculative decoding and print its statistics")
    add_model_args(demo)
    add_request_args(demo)
    demo.add_argument("--in-process", action="store_true", help="no Ray Serve: run draft and target in this process")
    demo.set_defaults(func=cmd_demo_in_process)

    vocab = sub.add_parser("vocab", help="static (FR-Spec) vocabulary artifacts")
    vsub = vocab.add_subparsers(dest="vocab_cmd", required=True)
    build = vsub.add_parser("build", help="count token frequencies over a corpus and keep the top K")
    build.add_argument("--corpus", nargs="+", required=True, help=".jsonl (see --field) or plain-text files")
    build.add_argument("--field", nargs="+", default=["text"], help="JSONL fields holding text (str or list of str)")
    build.add_argument("--size", type=int, default=32768)
    build.add_argument("--out", required=True)
    build.add_argument("--tokenizer", help="tokenizer folder (default: the offline Qwen3 tokenizer)")
    build.add_argument("--sglang-sizes", type=int, nargs="*", help="also export SGLang token maps of these sizes")
    exp = vsub.add_parser("export-sglang", help="artifact -> SGLang --speculative-token-map .pt")
    exp.add_argument("artifact")
    exp.add_argument("--out", required=True)
    exp.add_argument("--size", type=int)
    imp = vsub.add_parser("import-sglang", help="SGLang .pt token map -> artifact (validated)")
    imp.add_argument("token_map")
    imp.add_argument("--out", required=True)
    imp.add_argument("--tokenizer")
    cooc = vsub.add_parser("cooc", help="build the PubMedQA co-occurrence index for EvoSpec statistical retrieval")
    cooc.add_argument("--out", default="evospec/vocab/data/cooc-pubmedqa.safetensors")
    cooc.add_argument("--static-vocab", default="evospec/vocab/data/qwen3-specbench-32k.json")
    vocab.set_defaults(func=cmd_vocab)

    bench = sub.add_parser("bench", help="side-by-side benchmarks: v1 (ar/sd/frspec/HF), grid (EvoSpec table)")
    bench.add_argument("suite", choices=["v1", "grid", "random"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=lambda a: __import__(f"bench.{a.suite}", fromlist=["main"]).main(a.rest) or 0)

    train = sub.add_parser("train-tiny", help="retrain the embedded tiny Qwen3 pair (~15 CPU-minutes)")
    train.add_argument("rest", nargs=argparse.REMAINDER)
    train.set_defaults(func=lambda a: __import__("evospec.tiny_pair.train", fromlist=["main"]).main(a.rest) or 0)
    return ap


def main(argv: list[str] | None = None) -> int:
    from evospec.errors import InvalidRequestError
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
