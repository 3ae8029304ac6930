"""`evospec bench adapt`: online adaptation over a stream of medical requests served in order.

Arms (each in its own process, so its memory is its own; same prompts, same seeds, same order):
  frspec   FR-Spec (static vocabulary only), no adaptation: the reference of the paper's headline ratio
  off      EvoSpec (static + dynamic buffer), no adaptation
  lora     EvoSpec + online LoRA adaptation of the draft
  full     EvoSpec + full-parameter online distillation of the draft (the baseline LoRA is measured against)
Arms without adaptation are stationary (nothing in them changes along the stream), so `--stationary-window W` runs
them on the first and last W requests only (the comparisons are over those), which saves most of their time.

Per request: τ, tokens, seconds, tokens/s, the adapter version and training steps so far, and the process RSS.
Reported: τ and tok/s over the first and last W requests and as moving averages (plot), extra memory of each arm's
process over `off` (peak and steady, RSS) and the learner's own state (exact tensor bytes), training time share,
teacher-signal bytes per step, and greedy outputs compared across arms (they must all be the target's).

  evospec bench adapt --pair qwen2.5-coder --requests 100 --max-tokens 48          # the figures (docs/results.md)
  evospec bench adapt --pair tiny --requests 12 --max-tokens 32 --arms off lora     # a quick look
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch
from tqdm import tqdm

from evospec.config import AdaptConfig, SamplingParams, SpecParams
from evospec.datasets import pubmedqa_items
from evospec.loading import LoadedPair, load_named_pair
from evospec.modelstore.catalog import TINY, pair_names
from evospec.tokenizer import chat_prompt_ids

ARMS = ("frspec", "off", "lora", "full")
STATIONARY = ("frspec", "off")
MB = 1 << 20


def arm_spec(arm: str, static_size: int, dynamic_size: int) -> SpecParams:
    method = "frspec" if arm == "frspec" else "evospec"
    return SpecParams(method=method, vocab={"static_size": static_size, "dynamic_size": dynamic_size})


def arm_adapt(arm: str, base: AdaptConfig) -> AdaptConfig:
    return base.model_copy(update={"mode": arm if arm in ("lora", "full") else "off"})


def medical_stream(tokenizer, n: int) -> list[list[int]]:
    """The first n PubMedQA questions (by PubMed id) as single-turn chats, token ids."""
    items = pubmedqa_items()
    if n > len(items):
        raise ValueError(f"--requests {n}: PubMedQA has {len(items)} questions")
    return [chat_prompt_ids(tokenizer, [{"role": "user", "content": it["question"]}]) for it in items[:n]]


def stream_indices(arm: str, n: int, stationary_window: int) -> list[int]:
    if arm in STATIONARY and stationary_window and 2 * stationary_window < n:
        return [*range(stationary_window), *range(n - stationary_window, n)]
    return list(range(n))


class RssSampler:
    """This process's RSS every `every_s` seconds on a thread: the peak and the samples over time."""

    def __init__(self, every_s: float = 0.1):
        self.process, self.every_s = psutil.Process(), every_s
        self.samples: list[tuple[float, float]] = []
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.start_time = time.monotonic()

    def now_mb(self) -> float:
        return self.process.memory_info().rss / MB

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            rss = self.now_mb()
            self.peak = max(self.peak, rss)
            self.samples.append((round(time.monotonic() - self.start_time, 2), round(rss, 1)))

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def serve_stream(loaded: LoadedPair, prompts: list[list[int]], indices: list[int], spec: SpecParams,
                 sampling: SamplingParams, progress: str | None = None) -> dict:
    """Serve `prompts[i]` for i in `indices`, in order, one at a time (seed = i); per-request rows and totals."""
    decoder, learner = loaded.decoder, loaded.decoder.learner
    rows = []
    with RssSampler() as rss:
        start = time.perf_counter()
        for i in tqdm(indices, desc=progress, disable=progress is None, leave=False):
            t0 = time.perf_counter()
            gen = decoder.generate(prompts[i], sampling.model_copy(update={"seed": i}), spec)
            list(gen)
            seconds = time.perf_counter() - t0
            s = gen.stats
            rows.append({"index": i, "tau": s.tau, "tokens": s.generated_tokens, "steps": s.steps,
                         "seconds": seconds, "tokens_per_s": s.generated_tokens / seconds,
                         "step_seconds": (s.draft_seconds + s.verify_seconds) / max(1, s.steps),
                         "teacher_bytes": s.teacher_signal_bytes, "rss_mb": round(rss.now_mb(), 1),
                         "version": learner.stats.version if learner else 0,
                         "train_steps": learner.stats.train_steps if learner else 0,
                         "output": gen.output_ids})
        wall = time.perf_counter() - start
    return {"rows": rows, "wall_seconds": wall, "peak_rss_mb": round(rss.peak, 1), "rss_samples": rss.samples,
            "learner": None if learner is None else {
                **dataclasses.asdict(learner.stats), "state_mb": learner.stats.state_bytes / MB,
                "estimate_mb": learner.estimate_bytes() / MB}}


def run_worker(args) -> None:
    """One arm in this process: load, serve the stream, write the JSON."""
    torch.set_num_threads(args.threads)
    arm = args.worker
    adapt = arm_adapt(arm, adapt_config(args))
    loaded = load_named_pair(args.pair, draft_quantize=args.draft_quantize, adapt=adapt) if args.pair == TINY else \
        load_named_pair(args.pair, dtype=args.dtype, draft_quantize=args.draft_quantize, adapt=adapt)
    try:
        prompts = medical_stream(loaded.tokenizer, args.requests)
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True)
        spec = arm_spec(arm, args.static_size, args.dynamic_size)
        serve_stream(loaded, prompts[:1], [0], spec, sampling.model_copy(update={"max_tokens": 4}))  # warm-up
        result = serve_stream(loaded, prompts, stream_indices(arm, args.requests, args.stationary_window), spec,
                              sampling, progress=arm)
    finally:
        loaded.decoder.close()
    args.worker_out.write_text(json.dumps({"arm": arm, **result}))


def adapt_config(args) -> AdaptConfig:
    return AdaptConfig(rank=args.rank, lr=args.lr, teacher_top_k=args.teacher_top_k, window=args.window,
                       train_threads=args.train_threads, max_time_share=args.max_time_share,
                       publish_every=args.publish_every, memory_cap_mb=args.memory_cap_mb)


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def over(rows: list[dict], indices: set[int], key: str) -> float:
    return mean([r[key] for r in rows if r["index"] in indices])


def summarize(results: dict[str, dict], n: int, w: int) -> dict:
    """Per arm: first/last-w τ, tok/s and steps/s, memory over `off`, training share; outputs compared."""
    first, last = set(range(w)), set(range(n - w, n))
    table = {}
    off = results.get("off")
    for arm, res in results.items():
        rows = res["rows"]
        rss = [mb for _, mb in res["rss_samples"]]
        steady = statistics.median(rss[len(rss) * 3 // 4:]) if rss else float("nan")
        res["steady_rss_mb"] = steady
        learner = res["learner"] or {}
        table[arm] = {
            "tau_first": over(rows, first, "tau"), "tau_last": over(rows, last, "tau"),
            "tok_s_first": over(rows, first, "tokens_per_s"), "tok_s_last": over(rows, last, "tokens_per_s"),
            "steps_per_s_last": 1.0 / over(rows, last, "step_seconds"),
            "teacher_bytes_per_step": sum(r["teacher_bytes"] for r in rows) / max(1, sum(r["steps"] for r in rows)),
            "peak_rss_mb": res["peak_rss_mb"], "steady_rss_mb": steady,
            "train_share": learner.get("train_seconds", 0.0) / res["wall_seconds"],
            "versions": learner.get("version", 0), "train_steps": learner.get("train_steps", 0),
            "loss_ema": learner.get("loss_ema"), "state_mb": learner.get("state_mb", 0.0),
            "requests": len(rows),
        }
    if off is not None:
        for arm, row in table.items():
            row["extra_peak_mb"] = row["peak_rss_mb"] - table["off"]["peak_rss_mb"]
            row["extra_steady_mb"] = row["steady_rss_mb"] - table["off"]["steady_rss_mb"]
    outputs: dict[int, dict[str, list[int]]] = {}
    for arm, res in results.items():
        for r in res["rows"]:
            outputs.setdefault(r["index"], {})[arm] = r["output"]
    mismatches = [i for i, by_arm in outputs.items() if len({tuple(o) for o in by_arm.values()}) > 1]
    return {"arms": table, "compared_requests": sum(1 for v in outputs.values() if len(v) > 1),
            "output_mismatches": mismatches}


def goals(summary: dict) -> list[tuple[str, float, float]]:
    """(goal, measured, threshold) for the issue's goals that the arms run allow."""
    t = summary["arms"]
    out = []
    if "lora" in t and "frspec" in t:
        out.append(("evospec+LoRA tok/s ÷ frspec tok/s, last W", t["lora"]["tok_s_last"] / t["frspec"]["tok_s_last"],
                    1.10))
    if "lora" in t:
        out.append(("LoRA τ last W ÷ first W", t["lora"]["tau_last"] / t["lora"]["tau_first"], 1.10))
    if "lora" in t and "off" in t:
        out.append(("LoRA τ ÷ off τ, last W", t["lora"]["tau_last"] / t["off"]["tau_last"], 1.05))
        out.append(("LoRA steps/s ÷ off steps/s, last W (throughput at equal τ)",
                    t["lora"]["steps_per_s_last"] / t["off"]["steps_per_s_last"], 0.90))
    if "lora" in t and "full" in t and t["full"].get("extra_steady_mb", 0) > 0:
        out.append(("1 − LoRA extra ÷ full extra (steady RSS)",
                    1 - t["lora"]["extra_steady_mb"] / t["full"]["extra_steady_mb"], 0.27))
        out.append(("1 − LoRA state ÷ full state (learner bytes)",
                    1 - t["lora"]["state_mb"] / max(1e-9, t["full"]["state_mb"]), 0.27))
    if "lora" in t and "full" in t and t["full"].get("extra_peak_mb", 0) > 0:
        out.append(("1 − LoRA extra ÷ full extra (peak RSS)",
                    1 - t["lora"]["extra_peak_mb"] / t["full"]["extra_peak_mb"], 0.27))
    return out


def render(summary: dict, args) -> str:
    w = args.stationary_window
    lines = [f"# bench adapt: {args.pair}, {args.requests} PubMedQA questions in order, max_tokens {args.max_tokens}, "
             f"T={args.temperature}, draft {args.draft_quantize}, target {args.dtype}, static {args.static_size} + "
             f"dynamic {args.dynamic_size}, W = {w}", "",
             f"| arm | requests | τ first {w} | τ last {w} | tok/s first {w} | tok/s last {w} | steps/s last {w} | "
             "extra peak MB | extra steady MB | learner state MB | train share | versions | steps | loss EMA | "
             "signal B/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, r in summary["arms"].items():
        loss = f"{r['loss_ema']:.3f}" if r["loss_ema"] is not None else "-"
        lines.append(f"| {arm} | {r['requests']} | {r['tau_first']:.3f} | {r['tau_last']:.3f} | {r['tok_s_first']:.2f} "
                     f"| {r['tok_s_last']:.2f} | {r['steps_per_s_last']:.2f} | {r.get('extra_peak_mb', 0):.0f} | "
                     f"{r.get('extra_steady_mb', 0):.0f} | {r['state_mb']:.1f} | {r['train_share']:.2f} | "
                     f"{r['versions']} | {r['train_steps']} | {loss} | {r['teacher_bytes_per_step']:.0f} |")
    lines += ["", "| goal | measured | threshold | |", "|---|---|---|---|"]
    for name, value, threshold in goals(summary):
        lines.append(f"| {name} | {value:.3f} | {threshold} | {'met' if value >= threshold else 'not met'} |")
    lines += ["", f"Greedy outputs compared across arms on {summary['compared_requests']} requests: "
                  f"{len(summary['output_mismatches'])} differ {summary['output_mismatches'][:10]}"]
    return "\n".join(lines)


def plot(results: dict[str, dict], path: Path, window: int = 10) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for arm, res in results.items():
        rows = res["rows"]
        x = [r["index"] for r in rows]
        for ax, key in zip(axes[:2], ("tau", "tokens_per_s")):
            values = [r[key] for r in rows]
            smooth = [mean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]
            ax.plot(x, smooth, marker="." if arm in STATIONARY else None, linestyle="-" if arm not in STATIONARY
                    else "none", label=arm)
        times, rss = zip(*res["rss_samples"]) if res["rss_samples"] else ((), ())
        axes[2].plot(times, rss, label=arm)
    axes[0].set(title=f"τ (moving average over {window} requests)", xlabel="request")
    axes[1].set(title=f"tokens/s (moving average over {window} requests)", xlabel="request")
    axes[2].set(title="process RSS (MB)", xlabel="seconds")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_args(ap: argparse.ArgumentParser) -> None:
    base = AdaptConfig()
    ap.add_argument("--pair", default="qwen2.5-coder", choices=pair_names())
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--stationary-window", type=int, default=20,
                    help="W: arms without adaptation run on the first and last W requests only (0 = all)")
    ap.add_argument("--static-size", type=int, default=32768)
    ap.add_argument("--dynamic-size", type=int, default=256)
    ap.add_argument("--draft-quantize", default="int8", choices=("none", "int8"),
                    help="the draft's layers (real pairs; int8 = the shipped CPU config). The full-parameter arm "
                         "trains float weights: run it with none")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                    help="the target's (real pairs; auto: bf16 only where the CPU has it natively)")
    ap.add_argument("--rank", type=int, default=base.rank)
    ap.add_argument("--lr", type=float, default=base.lr)
    ap.add_argument("--teacher-top-k", type=int, default=base.teacher_top_k)
    ap.add_argument("--window", type=int, default=base.window)
    ap.add_argument("--publish-every", type=int, default=base.publish_every)
    ap.add_argument("--train-threads", type=int, default=base.train_threads)
    ap.add_argument("--max-time-share", type=float, default=base.max_time_share)
    ap.add_argument("--memory-cap-mb", type=float, default=16384.0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of serving")
    ap.add_argument("--out", type=Path, default=Path("results/bench_adapt"))
    ap.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="evospec bench adapt", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    if args.worker:
        return run_worker(args)
    if "full" in args.arms and args.draft_quantize == "int8" and args.pair != TINY:
        ap.error("the full-parameter arm trains float weights: use --draft-quantize none or drop 'full'")
    w = min(args.stationary_window or args.requests, args.requests // 2)
    args.stationary_window = w
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for arm in args.arms:  # one process per arm, one after another: its RSS is its own, nothing else runs
        out = args.out / f"arm_{arm}.json"
        print(f"[{arm}] serving the stream in its own process ...", flush=True)
        code = subprocess.run([sys.executable, "-m", "evospec.bench.adapt", *argv, "--worker", arm,
                               "--worker-out", str(out)]).returncode
        if code != 0:
            sys.exit(f"arm {arm} failed (exit code {code}); its error is printed above")
        results[arm] = json.loads(out.read_text())
    summary = summarize(results, args.requests, w)
    md = render(summary, args)
    (args.out / "bench_adapt.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                           "summary": summary}, indent=1))
    (args.out / "bench_adapt.md").write_text(md + "\n")
    plot(results, args.out / "bench_adapt.png")
    print(md)


if __name__ == "__main__":
    main()
