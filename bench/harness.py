"""Side-by-side benchmark harness: every method runs on the same models and prompts in one process, interleaved
per repeat (so machine drift hits all methods alike); results carry min/median/max over repeats and ratios."""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from evospec.config import SamplingParams, SpecParams
from evospec.engine.generate import SpeculativeDecoder
from evospec.engine.stats import SpecStats
from evospec.model.qwen3 import synchronize
from evospec.vocab.policy import SOURCES


@dataclass
class Arm:
    """One compared configuration. `run` (optional) replaces the in-process decoder: external peers return no
    statistics (speed only), the decoupled service returns its SpecStats; `decoder` (optional) replaces the shared
    one (e.g. the same target with another draft)."""
    name: str
    spec: SpecParams | None = None
    run: Callable[[list[int], SamplingParams], tuple[list[int], SpecStats | None]] | None = None
    decoder: SpeculativeDecoder | None = None


@dataclass
class Cell:
    """Measurements of one arm on one prompt set and temperature, over repeats."""
    tokens_per_s: list[float] = field(default_factory=list)
    tau: list[float] = field(default_factory=list)
    alpha: list[float] = field(default_factory=list)
    head_share: list[float] = field(default_factory=list)
    miss_rate: list[float] = field(default_factory=list)
    recovered: list[float] = field(default_factory=list)
    hits_statistical: list[float] = field(default_factory=list)
    hits_semantic: list[float] = field(default_factory=list)
    hits_target: list[float] = field(default_factory=list)
    buffer_churn: list[float] = field(default_factory=list)
    update_ms_per_step: list[float] = field(default_factory=list)
    draft_ms_per_step: list[float] = field(default_factory=list)
    verify_ms_per_step: list[float] = field(default_factory=list)
    tau_first32: list[float] = field(default_factory=list)
    tau_after32: list[float] = field(default_factory=list)
    acceptance_by_depth: list[list[float]] = field(default_factory=list)  # per repeat: P(a step accepts >= d)
    outputs: list[list[int]] | None = None


METRICS = ("tokens_per_s", "tau", "alpha", "head_share", "miss_rate", "recovered", "hits_statistical",
           "hits_semantic", "hits_target", "buffer_churn", "update_ms_per_step", "draft_ms_per_step",
           "verify_ms_per_step", "tau_first32", "tau_after32")
SUMMED = ("steps", "drafted", "accepted", "draft_seconds", "verify_seconds", "draft_head_seconds", "misses",
          "verified_positions", "buffer_updates", "buffer_update_seconds", "buffer_hits_statistical",
          "buffer_hits_semantic", "buffer_hits_target")
WINDOW = 32  # tokens: τ before and after this point of an answer (how fast the buffer adapts to a new context)


def summarize(values: list[float]) -> dict:
    if not values:
        return {}
    return {"min": round(min(values), 4), "median": round(statistics.median(values), 4), "max": round(max(values), 4)}


def run_ms(fn, repeats: int, device: torch.device = torch.device("cpu")) -> list[float]:
    """ms of `repeats` runs of `fn` after one untimed one (first calls choose kernels), each timed to the device's
    end, fastest first."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(1000 * (time.perf_counter() - start))
    return sorted(times)


def median_by_depth(repeats: list[list[float]]) -> list[float]:
    """Per depth d (1-based position d - 1), the median over repeats of the share of steps that accepted at least d
    drafted tokens (a repeat that never reached depth d counts 0)."""
    depths = max(map(len, repeats))
    return [round(statistics.median(r[d] if d < len(r) else 0.0 for r in repeats), 4) for d in range(depths)]


def generate_in_process(decoder: SpeculativeDecoder, prompt: list[int], sampling: SamplingParams,
                        spec: SpecParams) -> tuple[list[int], SpecStats, list[int]]:
    """-> (output, statistics, tokens committed by each step)."""
    gen = decoder.generate(prompt, sampling, spec)
    per_step = [len(chunk.token_ids) for chunk in gen]
    return gen.output_ids, gen.stats, per_step


def run_arm(decoder: SpeculativeDecoder, arm: Arm, prompts: list[list[int]],
            sampling: SamplingParams) -> tuple[dict, list[list[int]]]:
    """Generate every prompt once; returns aggregate metrics for this repeat and the outputs."""
    total = SpecStats()
    outputs, generated, first, after = [], 0, [], []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        params = sampling.model_copy(update={"seed": sampling.seed + i if sampling.seed is not None else None})
        if arm.run is not None:
            out, stats = arm.run(prompt, params)
        else:
            out, stats, per_step = generate_in_process(arm.decoder or decoder, prompt, params, arm.spec)
            per_step = per_step[:-1]  # the last step's tokens may be cut by max_tokens or a stop token
            starts = [sum(per_step[:j]) for j in range(len(per_step))]
            first += [n for n, at in zip(per_step, starts) if at < WINDOW]
            after += [n for n, at in zip(per_step, starts) if at >= WINDOW]
        if stats is not None:
            for name in SUMMED:
                setattr(total, name, getattr(total, name) + getattr(stats, name))
            total.accepted_per_pos = [a + b for a, b in zip_longest(total.accepted_per_pos, stats.accepted_per_pos,
                                                                    fillvalue=0)]
        outputs.append(out)
        generated += len(out)
    elapsed = time.perf_counter() - start
    if not total.steps:  # external peers report speed only
        return {"tokens_per_s": generated / elapsed}, outputs
    return {"tokens_per_s": generated / elapsed, **step_metrics(total),
            **({"tau_first32": statistics.mean(first)} if first else {}),
            **({"tau_after32": statistics.mean(after)} if after else {})}, outputs


def step_metrics(total: SpecStats) -> dict:
    """Per-step and vocabulary metrics of summed statistics. recovered = share of the target's tokens outside S that
    the buffer held (hits / (hits + misses)); hits_<source> = that source's share of the hits."""
    hits = total.buffer_hits
    per_step = 1000 / total.steps
    return {"tau": total.tau, "alpha": total.alpha,
            "acceptance_by_depth": [count / total.steps for count in total.accepted_per_pos],
            "head_share": total.draft_head_seconds / total.draft_seconds if total.draft_seconds else 0.0,
            "miss_rate": total.miss_rate,
            "recovered": hits / (hits + total.misses) if hits + total.misses else 0.0,
            **{f"hits_{source}": getattr(total, f"buffer_hits_{source}") / hits if hits else 0.0
               for source in SOURCES},
            "buffer_churn": total.buffer_updates / total.steps,
            "update_ms_per_step": total.buffer_update_seconds * per_step,
            "draft_ms_per_step": total.draft_seconds * per_step,
            "verify_ms_per_step": total.verify_seconds * per_step}


def run_side_by_side(decoder: SpeculativeDecoder, arms: list[Arm], prompt_sets: dict[str, list[list[int]]],
                     samplings: dict[str, SamplingParams], repeats: int, warmup: bool = True) -> dict:
    """-> {(set, temp): {arm: Cell}} serialized as nested dicts, with a greedy-identity check against `ar`."""
    cells: dict[tuple[str, str, str], Cell] = {}
    jobs = [(s, t) for s in prompt_sets for t in samplings]
    if warmup:  # first-call costs (allocator, gathers) must not land on whichever arm runs first
        for arm in arms:
            run_arm(decoder, arm, list(prompt_sets.values())[0][:1],
                    list(samplings.values())[0].model_copy(update={"max_tokens": 8}))
    with tqdm(total=repeats * len(jobs) * len(arms), desc="bench") as bar:
        for rep in range(repeats):
            for set_name, temp_name in jobs:
                order = arms if rep % 2 == 0 else arms[::-1]
                for arm in order:
                    metrics, outputs = run_arm(decoder, arm, prompt_sets[set_name], samplings[temp_name])
                    cell = cells.setdefault((set_name, temp_name, arm.name), Cell())
                    for k, v in metrics.items():
                        getattr(cell, k).append(v)
                    if cell.outputs is None:
                        cell.outputs = outputs
                    bar.update(1)
    return finalize(cells, arms, prompt_sets, samplings)


def finalize(cells, arms, prompt_sets, samplings) -> dict:
    results = {}
    for set_name in prompt_sets:
        for temp_name, sampling in samplings.items():
            key = f"{set_name}/{temp_name}"
            row = {}
            ar = cells.get((set_name, temp_name, "ar"))
            ar_tps = statistics.median(ar.tokens_per_s) if ar else None
            for arm in arms:
                c = cells[(set_name, temp_name, arm.name)]
                entry = {m: summarize(getattr(c, m)) for m in METRICS}
                if c.acceptance_by_depth:
                    entry["acceptance_by_depth"] = median_by_depth(c.acceptance_by_depth)
                if ar_tps:
                    entry["speedup_vs_ar"] = round(statistics.median(c.tokens_per_s) / ar_tps, 3)
                if sampling.greedy and ar is not None:
                    entry["greedy_identical_to_ar"] = c.outputs == ar.outputs
                row[arm.name] = entry
            results[key] = row
    return results


def markdown_table(results: dict, columns=("tokens_per_s", "speedup_vs_ar", "tau", "alpha", "head_share",
                                             "miss_rate", "greedy_identical_to_ar")) -> str:
    lines = []
    for key, row in results.items():
        lines.append(f"\n### {key}\n")
        lines.append("| method | " + " | ".join(columns) + " |")
        lines.append("|---" * (len(columns) + 1) + "|")
        for name, entry in row.items():
            cells = []
            for col in columns:
                v = entry.get(col, "")
                if isinstance(v, dict) and v:
                    cells.append(f"{v['median']:.3g} ({v['min']:.3g}–{v['max']:.3g})")
                elif isinstance(v, bool):
                    cells.append("yes" if v else "**NO**")
                else:
                    cells.append(str(v) if v not in ("", {}) else "–")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path, metric: str = "tokens_per_s") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = list(results)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        names = list(results[key])
        med = [results[key][n][metric]["median"] for n in names]
        lo = [m - results[key][n][metric]["min"] for m, n in zip(med, names)]
        hi = [results[key][n][metric]["max"] - m for m, n in zip(med, names)]
        ax.bar(range(len(names)), med, yerr=[lo, hi], capsize=3, color="tab:blue")
        ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
        ax.set_title(key, fontsize=9)
        ax.set_ylabel(metric)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(results: dict, meta: dict, out_dir: Path, name: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    md = f"# {name}\n\n```\n{json.dumps(meta, indent=1)}\n```\n" + markdown_table(results)
    (out_dir / f"{name}.md").write_text(md)
    plot(results, out_dir / f"{name}.png")
    print(md)
