"""How far prompt lookup (`lookup`, evospec/engine/lookup.py) could take each prompt set, and with which n-gram size,
choice of occurrence and chain lengths: the sizing study behind the LOOKUP_* defaults (evospec/config.py;
docs/results.md, "Prompt lookup" and "Chains as long as their match").

    evospec bench lookup                              # the shipped YAML's target; medical-rag, code, chat; 6 prompts
    evospec bench lookup --requests 3 --max-tokens 64 --sets code
    evospec bench lookup --replay results/bench_lookup/lookup.json   # a saved run's answers and costs, no model

1. The target, loaded as the YAML says, answers each prompt greedily with `ar` in this process (the real answers).
2. Each answer is replayed through prompt lookup offline (the method's own `NgramIndex`, extended by each step's
   committed tokens, as the scheduler does) for every n-gram range and chain length of the grid: a step proposes a
   chain, commits its matching prefix and the target's next token.
3. A step is priced as one target forward of 1 + drafted rows, from this machine's measured forwards
   (`forward_seconds` with the head, after a short context), so the estimate is `ar`'s time per token over the
   replay's: the speed-up the method would reach here if every step drafted its full proposal (the service's budget
   may draft less). An estimate for choosing defaults, not a measurement of the service: `evospec bench peers
   --arms ar lookup` is that.

The answers and costs are saved in lookup.json, so `--replay` studies another grid over them in seconds.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from evospec.bench.formats import first_divergence
from evospec.bench.service import DEFAULT_CONFIG, environment, progress
from evospec.config import LOOKUP_CANDIDATES, LOOKUP_CHAIN_BY_MATCH, LOOKUP_MIN_NGRAM, SamplingParams, SpecParams
from evospec.datasets import REALISTIC_PROMPT_SETS
from evospec.engine.generate import SpeculativeDecoder
from evospec.engine.lookup import NgramIndex
from evospec.loading import apply_cpu_settings, load_model, stop_token_ids
from evospec.model.qwen3 import forward_seconds
from evospec.orchestration.config import AppConfig
from evospec.tokenizer import chat_prompt_ids, load_tokenizer

ESTIMATE_NOTE = ("est. vs ar = ar's time per token (one 1-row forward) / the replay's (each step priced as one "
                 "forward of 1 + drafted rows); an estimate for choosing defaults, not a service measurement.")


@dataclass(frozen=True)
class Variant:
    """One way to run prompt lookup: n-gram size, occurrences compared (1 = the latest alone), chain limits by match
    length (() = none) and the step's depth k."""
    min_n: int
    candidates: int
    chain_by_match: tuple[tuple[int, int], ...]
    k: int

    @property
    def default(self) -> bool:
        return (self.min_n, self.candidates, self.chain_by_match) == (LOOKUP_MIN_NGRAM, LOOKUP_CANDIDATES,
                                                                       LOOKUP_CHAIN_BY_MATCH)

    @property
    def label(self) -> str:
        choice = "latest" if self.candidates == 1 else f"longest of {self.candidates}"
        limits = ", ".join(f"<{n}: {c}" for n, c in self.chain_by_match) or "none"
        return f"{self.min_n}-gram, {choice}, limits {limits}"


GRID = [Variant(2, 1, (), 1), Variant(2, 1, (), 2), Variant(3, 1, (), 2), Variant(3, 1, (), 4),
        Variant(3, LOOKUP_CANDIDATES, (), 4), Variant(3, LOOKUP_CANDIDATES, (), 6),
        Variant(3, LOOKUP_CANDIDATES, LOOKUP_CHAIN_BY_MATCH, 4),
        Variant(3, LOOKUP_CANDIDATES, LOOKUP_CHAIN_BY_MATCH, 6),
        Variant(3, LOOKUP_CANDIDATES, ((4, 1), (6, 2), (8, 3)), 6), Variant(3, LOOKUP_CANDIDATES, ((5, 1),), 4),
        Variant(2, LOOKUP_CANDIDATES, ((3, 1), (4, 1), (6, 2)), 4)]
LARGEST_FORWARD = 1 + max(variant.k for variant in GRID)  # rows of the biggest step the grid prices


@dataclass(frozen=True)
class Replay:
    tokens: int  # output tokens replayed
    steps: int
    drafted: int
    accepted: int
    seconds: float  # priced by the measured forwards


def replay(prompt: list[int], answer: list[int], variant: Variant, cost: dict[int, float]) -> Replay:
    """Prompt lookup over a known greedy answer: what each step would propose, accept and cost."""
    index = NgramIndex(prompt, variant.min_n, candidates=variant.candidates, chain_by_match=variant.chain_by_match)
    k = variant.k
    done = steps = drafted = accepted = 0
    seconds = 0.0
    while done < len(answer):
        proposal = index.propose(k)
        matched = first_divergence(proposal, answer[done:])  # the accepted prefix of the chain
        committed = answer[done:done + matched + 1]
        index.extend(committed)
        done += len(committed)
        steps, drafted, accepted = steps + 1, drafted + len(proposal), accepted + matched
        seconds += cost[1 + len(proposal)]
    return Replay(len(answer), steps, drafted, accepted, seconds)


def greedy_answers(decoder: SpeculativeDecoder, tokenizer, sets: list[str], requests: int, max_tokens: int,
                   seed: int, started: float) -> dict[str, list[tuple[list[int], list[int]]]]:
    out = {}
    for name in sets:
        out[name] = []
        for i, messages in enumerate(REALISTIC_PROMPT_SETS[name](requests, seed)):
            prompt = chat_prompt_ids(tokenizer, messages)
            gen = decoder.generate(prompt, SamplingParams(max_tokens=max_tokens), SpecParams(method="ar"))
            for _ in gen:
                pass
            out[name].append((prompt, gen.output_ids))
            progress(f"{name} {i + 1}/{requests}: {len(prompt)} prompt tokens, {len(gen.output_ids)} answered", started)
    return out


def estimate_rows(answers: dict[str, list[tuple[list[int], list[int]]]], cost: dict[int, float]) -> list[dict]:
    rows = []
    for variant in GRID:
        for name, pairs in answers.items():
            runs = [replay(prompt, answer, variant, cost) for prompt, answer in pairs]
            tokens = sum(r.tokens for r in runs)
            seconds = sum(r.seconds for r in runs)
            drafted = sum(r.drafted for r in runs)
            rows.append({"variant": variant.label, "chain": variant.k, "set": name,
                         "vs_ar": round(tokens * cost[1] / max(seconds, 1e-9), 3),
                         "tau": round(tokens / max(1, sum(r.steps for r in runs)), 2),
                         "accepted": sum(r.accepted for r in runs), "drafted": drafted,
                         "default": variant.default})
    return rows


def markdown(rows: list[dict], cost: dict[int, float], meta: dict) -> str:
    sets = list(dict.fromkeys(r["set"] for r in rows))
    env = meta["environment"]
    forwards = ", ".join(f"{n}: {1000 * s:.1f}" for n, s in sorted(cost.items()))
    machine = (f"CPU: {env['cpu']}; torch capability {env['cpu_capability']}; {meta['args']['requests']} prompts "
               f"per set, {meta['args']['max_tokens']} tokens")
    lines = ["# bench lookup: prompt lookup replayed over greedy `ar` answers", "", machine, "",
             f"Target forward ms by rows (with the head): {forwards}", "",
             "| proposal | chain | " + " | ".join(f"{s}: est. vs ar (τ, accepted/drafted)" for s in sets) + " |",
             "|---|---|" + "---|" * len(sets)]
    for variant in GRID:
        cells = [next(r for r in rows if r["set"] == s and r["variant"] == variant.label and r["chain"] == variant.k)
                 for s in sets]
        mark = " (default)" if variant.default else ""
        lines.append(f"| {variant.label}{mark} | {variant.k} | " + " | ".join(
            f"{c['vs_ar']:.2f}x ({c['tau']:.2f}, {c['accepted']}/{c['drafted']})" for c in cells) + " |")
    lines += ["", ESTIMATE_NOTE]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="evospec bench lookup", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help=f"the service YAML (default {DEFAULT_CONFIG})")
    ap.add_argument("--sets", nargs="+", default=["medical-rag", "code", "chat"], choices=list(REALISTIC_PROMPT_SETS))
    ap.add_argument("--requests", type=int, default=6, help="prompts per set (default 6)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1, help="prompt order")
    ap.add_argument("--replay", help="a lookup.json of an earlier run: replay its answers and forward costs (no model)")
    ap.add_argument("--out", default="results/bench_lookup")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replay:
        answers, cost, measured = saved_run(Path(args.replay), args.sets)
    else:
        answers, cost, measured = measure(args)
    rows = estimate_rows(answers, cost)
    machine = measured.pop("environment")  # the machine the answers and costs were measured on
    meta = {"args": {**vars(args), **measured}, "environment": machine, "forward_seconds": cost}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    replayable = {name: [{"prompt": p, "answer": a} for p, a in pairs] for name, pairs in answers.items()}
    (out / "lookup.json").write_text(json.dumps({"meta": meta, "rows": rows, "answers": replayable}))
    text = markdown(rows, cost, meta)
    (out / "lookup.md").write_text(text)
    print(text)
    return 0


def measure(args: argparse.Namespace) -> tuple[dict, dict[int, float], dict]:
    """The target's greedy answers to the prompt sets and its forward seconds by rows, on this machine."""
    started = time.monotonic()
    cfg = AppConfig.from_yaml(args.config)
    apply_cpu_settings(cfg.target.model)
    progress(f"loading the target from {args.config}", started)
    model, folder = load_model(cfg.target.model, "target")
    decoder = SpeculativeDecoder(model, None, max_model_len=cfg.target.max_model_len, eos_ids=stop_token_ids(folder))
    cost = forward_seconds(model, sizes=tuple(range(1, LARGEST_FORWARD + 1)), context=256, repeats=3, with_head=True)
    answers = greedy_answers(decoder, load_tokenizer(str(folder)), args.sets, args.requests, args.max_tokens,
                             args.seed, started)
    return answers, cost, {"environment": environment()}


def saved_run(path: Path, sets: list[str]) -> tuple[dict, dict[int, float], dict]:
    """The answers, forward seconds and machine of an earlier run's lookup.json (the CPU named in the output is that
    run's)."""
    try:
        saved = json.loads(path.read_text())
        answers = {name: [(pair["prompt"], pair["answer"]) for pair in pairs]
                   for name, pairs in saved["answers"].items() if name in sets}
        cost = {int(rows): seconds for rows, seconds in saved["meta"]["forward_seconds"].items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"--replay {path}: not a lookup.json with saved answers ({type(exc).__name__}: {exc}); "
                         "runs before answers were saved cannot be replayed") from None
    if not answers or max(cost) < LARGEST_FORWARD:
        raise SystemExit(f"--replay {path}: needs answers for {sets} and forward costs up to {LARGEST_FORWARD} rows")
    measured = {key: saved["meta"]["args"][key] for key in ("requests", "max_tokens", "seed")}
    return answers, cost, {**measured, "replayed_from": str(path), "environment": saved["meta"]["environment"]}
