"""The miss study: how often real text leaves the static vocabulary S, and how much of that the dynamic buffer D
recovers, per retrieval source, with the draft-head cost per row. No generation: real text is replayed through the
EvoSpec session vocabulary as if the target had committed it, 3 tokens per step (the measured τ of the real pair is
about 3), so every domain gets thousands of positions in seconds instead of the ~100 a generation run affords.

    evospec bench misses [--pair qwen2.5-coder] [--docs 30] [--out results/misses]

Domains (the streams the target "commits"): medical = held-out PubMedQA abstract + long answer, after its question;
code = the real source of stdlib functions (docstring included, so part of it repeats the request), after the "write
this function" request; general = Spec-Bench turns; topic-switch = the medical stream after another medical Q/A, a
code request and its source, and the question. Everything else is as served: the default co-occurrence index, the
buffer update applied one step later (update_lag 1). Target-fed candidates are the misses only (replay has no target
distribution, so the target's likely-but-not-committed ids, which the service also feeds, are left out: the target
source is a lower bound here). --docs is at most 30 (the held-out medical items are split between streams and the
topic switch's first turn).
"""
from __future__ import annotations

import argparse
import inspect
import json
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from evospec.bench.grid import head_costs
from evospec.bench.prompts import code_request, stdlib_functions
from evospec.datasets import spec_bench_prompts, split_pubmedqa
from evospec.engine.drafter import FeedbackRequest, feedbacks_for
from evospec.engine.stats import SpecStats
from evospec.engine.target import VerifiedStep
from evospec.loading import load_cooc, load_qwen3_folder, load_static_ids, named_pair_folders
from evospec.modelstore.catalog import get_pair, pair_names
from evospec.tokenizer import load_tokenizer
from evospec.verify import VerifyResult
from evospec.vocab.policy import SOURCES, EvoSpecPolicy, EvoSpecSettings, buffer_worker, trained_rows
from evospec.vocab.retrieval import TARGET_PRIORITY, EmbeddingIndex, TargetFeedback

STEP = 3  # tokens committed per replayed step


def domain_streams(tokenizer, docs: int) -> dict[str, list[tuple[list[int], list[int]]]]:
    """{domain: [(prompt ids, committed stream ids)]}."""
    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    _, held = split_pubmedqa()
    docs = min(docs, len(held) // 2)
    medical = [(ids(it["question"]), ids(" ".join(it["contexts"]) + " " + it["answer"])) for it in held[:docs]]
    functions = [fn for fn in stdlib_functions() if has_source(fn)][:docs]
    code = [(ids(code_request(fn)), ids(inspect.getsource(fn))) for fn in functions]
    general = []
    for row in spec_bench_prompts()[:docs]:
        text = ids(" ".join(row["turns"]))
        general.append((text[:8], text[8:]))
    switch = [(ids("\n\n".join([held[-1 - k]["question"], held[-1 - k]["answer"], code_request(functions[k]),
                                   inspect.getsource(functions[k]), held[k]["question"]])), stream)
              for k, (_, stream) in enumerate(medical)]
    return {"medical": medical, "code": code, "general": general, "topic-switch": switch}


def has_source(fn) -> bool:
    try:
        inspect.getsource(fn)
        return True
    except OSError:  # defined from generated code (no file lines to show)
        return False


def replay(policy: EvoSpecPolicy, streams: list[tuple[list[int], list[int]]]) -> SpecStats:
    """Misses and hits of every stream committed STEP tokens at a time, counted as the target counts them."""
    total = SpecStats()
    for prompt, stream in streams:
        session = policy.new_session(prompt)
        for i in range(0, len(stream) - STEP + 1, STEP):
            tokens = stream[i:i + STEP]
            result = VerifyResult(list(range(STEP - 1)), tokens[:-1], tokens[-1])
            fb, = feedbacks_for([FeedbackRequest(VerifiedStep(result, torch.zeros(1, 1)), session.in_active(), False,
                                                 total, session.source_of)])
            misses = {t: TARGET_PRIORITY + 1.0 for t in tokens if not session.in_active()[t]}
            feedback = TargetFeedback(fb.misses, fb.positions, misses) if session.wants_target_feedback else None
            session.observe(result, feedback)
        session.close()
    return total


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="qwen2.5-coder", choices=[p for p in pair_names() if p != "tiny"])
    ap.add_argument("--docs", type=int, default=30, help="documents per domain")
    ap.add_argument("--statics", nargs="+", type=int, default=[8192, 16384, 32768])
    ap.add_argument("--dynamics", nargs="+", type=int, default=[256, 1024])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("results/misses"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    folders = named_pair_folders(args.pair)
    draft = load_qwen3_folder(folders["draft"], "float32", device="cpu")
    weight = draft.head_weight.detach()
    static_ids, _ = load_static_ids(get_pair(args.pair).static_vocab)
    tokenizer = load_tokenizer(str(folders["target"]))
    streams = domain_streams(tokenizer, args.docs)
    index = EmbeddingIndex(weight, trained_rows(weight).nonzero()[:, 0])
    cooc, worker = load_cooc(None), buffer_worker()  # as the server has them
    variants = {"all": SOURCES, **{source: (source,) for source in SOURCES}}
    rows = []
    jobs = [(d, k, n, v) for d in streams for k in args.statics for n in args.dynamics for v in variants
            if v == "all" or n == min(args.dynamics)]
    for domain, k, dyna, variant in tqdm(jobs, desc="replay"):
        sources = variants[variant]
        settings = replace(EvoSpecSettings(), dynamic_size=dyna, use_statistical="statistical" in sources,
                           use_semantic="semantic" in sources, use_target="target" in sources)
        policy = EvoSpecPolicy(weight, static_ids[:k], settings, cooc, index, worker)
        stats = replay(policy, streams[domain])
        outside_s = stats.misses + stats.buffer_hits
        rows.append({"domain": domain, "static": k, "dynamic": dyna, "sources": variant,
                     "positions": stats.verified_positions, "outside_s": outside_s / stats.verified_positions,
                     "recovered": stats.buffer_hits / outside_s if outside_s else 0.0,
                     **{f"recovered_{s}": getattr(stats, f"buffer_hits_{s}") / outside_s if outside_s else 0.0
                        for s in SOURCES}})
    costs = head_costs(weight, static_ids, args.statics, args.dynamics, rows=(1,))["rows=1"]
    per_1k_rows_us = {name: round(1e6 * ms / rows_of(name, weight.shape[0]), 2) for name, ms in costs.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "misses.json").write_text(json.dumps({"pair": args.pair, "docs": args.docs, "step": STEP,
                                                      "rows": rows, "head_ms": costs,
                                                      "head_us_per_1k_rows": per_1k_rows_us},
                                                     indent=1))
    md = render(rows, costs, per_1k_rows_us)
    (args.out / "misses.md").write_text(md)
    print(md)


def rows_of(name: str, vocab: int) -> int:
    """'full' / '16k' / '16k+1024' -> rows of that head."""
    if name == "full":
        return vocab
    static, _, dyna = name.partition("+")
    return int(static[:-1]) * 1024 + (int(dyna) if dyna else 0)


def render(rows: list[dict], costs: dict, per_1k_rows_us: dict) -> str:
    lines = ["| domain | K | Dyna | positions | outside S | recovered by D (all sources) | of which by stat / sem / "
             "target | recovered by one source alone: stat / sem / target |", "|---" * 8 + "|"]
    by_key = {(r["domain"], r["static"], r["dynamic"], r["sources"]): r for r in rows}
    for r in rows:
        if r["sources"] != "all":
            continue
        alone = [by_key.get((r["domain"], r["static"], r["dynamic"], s)) for s in SOURCES]
        alone_txt = " / ".join(f"{a['recovered']:.0%}" for a in alone) if all(alone) else ""
        lines.append(f"| {r['domain']} | {r['static'] // 1024}k | {r['dynamic']} | {r['positions']} | "
                     f"{r['outside_s']:.1%} | {r['recovered']:.0%} | {r['recovered_statistical']:.0%} / "
                     f"{r['recovered_semantic']:.0%} / {r['recovered_target']:.0%} | {alone_txt} |")
    lines += ["", "| draft head (1 row) | " + " | ".join(costs) + " |", "|---" * (len(costs) + 1) + "|",
              "| ms | " + " | ".join(f"{v:.3f}" for v in costs.values()) + " |",
              "| µs per 1k rows | " + " | ".join(f"{v:.2f}" for v in per_1k_rows_us.values()) + " |"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
