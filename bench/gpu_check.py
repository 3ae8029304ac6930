"""What the project does on a GPU, in one short run (scripts/gpu_check.sh calls this), and the same run on tiny
models on the CPU, so it never rots (CI runs `scripts/gpu_check.sh --cpu`).

    scripts/gpu_check.sh            # one GPU: Qwen3-1.7B- and Qwen3-4B-shaped models, random weights, bf16
    scripts/gpu_check.sh --cpu      # the same steps with the tiny shapes, float32, on the CPU

Nothing is downloaded: the production shapes come from the models' published configs (`SHAPES`) with random
weights (a forward's cost depends on the shapes, not on the values). Acceptance is not random, though: the engine
steps replay the real pair's measured acceptance by depth (bench/replay.py), so each step commits as many tokens as
the real pair's would, and the projection (bench/projection.py `from_gpu_check`) reads cost and τ from the same run.
Steps, each recorded in gpu_check.json (a step that fails is recorded with its error; the others still run):

1. environment: the device, torch and CUDA versions, the CPU's capability;
2. tests/gpu (pytest: skipped without CUDA);
3. forward: ms of one target and one draft forward (full LM head) by new tokens at batch 1, and by batch at one new
   token per sequence, after a `context`-token prefix;
4. engine: ms per step, τ and tokens/s of `ar`, `sd`, `frspec` 32k and `evospec` 32k+256, chain and tree (the
   shapes whose acceptance the real pair measured: results/acceptance_real), in process, both models on one device,
   trees of fixed shape, acceptance replayed;
5. verify: host synchronisations per batched verify step (torch.cuda.set_sync_debug_mode on a GPU; on a CPU the
   count is the unit test's, tests/unit/test_verify_batch.py);
6. decoupled: `evospec bench decoupled --full-trees` on the tiny pair, draft and target sharing the device
   (orchestration/configs/gpu-tiny.yaml; cpu-tiny.yaml with --cpu, one short cell), against the same engine in
   process: the transport's cost per step. Through Ray Serve where Ray is installed, else `--transport local` (the
   GPU image has no Ray): the draft replica in its own process behind the same speculation stream.
Writes gpu_check.json and gpu_check.md under --out ($OUT, else results/gpu/).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from evospec.bench.harness import run_ms
from evospec.bench.replay import ACCEPTANCE_RESULTS, ReplayedAcceptance, measured_acceptance, replayed
from evospec.config import SamplingParams, SpecParams, TreeParams
from evospec.loading import cpu_description
from evospec.model import Qwen3, Qwen3Config, Segment
from evospec.model.qwen3 import forward_seconds, synchronize
from evospec.testing import random_qwen3, tiny_config

# Hugging Face config.json of Qwen/Qwen3-1.7B and Qwen/Qwen3-4B (the fields a forward's cost depends on).
SHAPES = {
    "draft": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "target": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
}
# The same steps on the CPU: a vocabulary large enough for a 32k static set, two tiny decoders.
CPU_SHAPES = {"draft": tiny_config(vocab=40960, hidden=64, layers=1, eos=-1),
              "target": tiny_config(vocab=40960, hidden=64, layers=2, eos=-1)}
CHAIN = TreeParams(shape="chain", num_draft_tokens=4)
TREE = TreeParams(shape="tree", depth=4, branching=2, budget=8)
METHODS = ("ar", "sd", "frspec", "evospec")  # the vocabularies are SpecParams' defaults: static 32k, dynamic 256


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (CI)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "results/gpu"))
    args = ap.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --cpu for the CPU check", file=sys.stderr)
        return 2
    device, dtype = (torch.device("cpu"), torch.float32) if args.cpu else (torch.device("cuda"), torch.bfloat16)
    if args.cpu:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    start = time.monotonic()
    report: dict = {"mode": "cpu" if args.cpu else "gpu", "environment": environment(device)}
    report["tests_gpu"] = step(run_gpu_tests)
    target, draft = step_models(report, args.cpu, device, dtype)
    if target is not None:
        context = 32 if args.cpu else 512
        report["forward_ms"] = step(lambda: {"target": forward_costs(target, context, args.cpu),
                                             "draft": forward_costs(draft, context, args.cpu)})
        report["engine_ms_per_step"] = step(lambda: engine_steps(target, draft, max_tokens=16 if args.cpu else 96))
        del target, draft
    report["verify_host_syncs"] = step(lambda: verify_syncs(device))
    report["decoupled"] = step(lambda: decoupled(args.out, args.cpu))
    report["elapsed_s"] = round(time.monotonic() - start, 1)
    write(report, args.out)
    failed = [name for name, part in report.items() if isinstance(part, dict) and "error" in part]
    print(f"gpu_check: {report['elapsed_s']} s, wrote {args.out}/gpu_check.json and .md"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def step(fn):
    """Run one step; a failure is recorded (type and message), not raised, so the other steps still run."""
    t0 = time.monotonic()
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - the report says what failed
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": round(time.monotonic() - t0, 1)}
    return {**out, "seconds": round(time.monotonic() - t0, 1)} if isinstance(out, dict) else out


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "cpu": cpu_description(), "threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device=props.name, memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    else:
        env["device"] = "cpu"
    return env


def run_gpu_tests() -> dict:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"],
                          capture_output=True, text=True, timeout=300)
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    out = {"rc": proc.returncode, "summary": summary}
    if proc.returncode not in (0, 5):
        out["error"] = proc.stdout[-2000:]
    return out


def step_models(report: dict, cpu: bool, device: torch.device, dtype: torch.dtype):
    """The (target, draft) pair of random models at the production shapes (or the tiny ones with --cpu)."""
    configs = CPU_SHAPES if cpu else {k: Qwen3Config(**v, eos_token_id=-1) for k, v in SHAPES.items()}
    models = {}

    def build():
        for seed, (role, cfg) in enumerate(configs.items()):
            models[role] = random_qwen3(cfg, seed, device=device, dtype=dtype)
        return {role: {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size,
                       "parameters_m": round(sum(p.numel() for p in models[role].parameters()) / 1e6, 1)}
                for role, cfg in configs.items()}
    report["models"] = step(build)
    return models.get("target"), models.get("draft")


@torch.inference_mode()
def forward_costs(model: Qwen3, context: int, cpu: bool) -> dict:
    """ms of one forward with the full LM head: by new tokens at batch 1 (the budget's own measurement,
    `forward_seconds`), and by batch at one new token each (packed, as the scheduler runs a batch)."""
    tokens = (1, 2, 4, 8, 16, 32, 64)
    batches = (1, 2, 4, 8) if cpu else (1, 2, 4, 8, 16, 32)
    caches = [prefilled_cache(model, context, 1) for _ in range(max(batches))]
    by_tokens = {n: round(1000 * s, 3) for n, s in forward_seconds(model, tokens, context, with_head=True).items()}
    device = model.embed_tokens.weight.device
    by_batch = {b: round(run_ms(lambda b=b: forward(caches[:b], model, 1), 3, device)[0], 3) for b in batches}
    return {"context": context, "by_new_tokens": by_tokens, "by_batch": by_batch}


def prefilled_cache(model: Qwen3, context: int, room: int):
    cache = model.new_cache(context + room)
    model.forward_packed([Segment.chain(cache, [i % model.cfg.vocab_size for i in range(context)])])
    cache.advance(context)
    return cache


def forward(caches, model: Qwen3, n: int) -> None:
    """n new tokens per cache, not committed (the next call writes the same slots)."""
    hidden = model.forward_packed([Segment.chain(c, [7 + i for i in range(n)]) for c in caches])
    model.full_logits(hidden)


def engine_steps(target: Qwen3, draft: Qwen3, max_tokens: int) -> dict:
    """ms per engine step, τ and tokens/s of each method and tree shape (greedy, ignore_eos, one request), in
    process, with the real pair's acceptance by depth replayed (bench/replay.py)."""
    from evospec.bench.projection import ARMS
    from evospec.engine.generate import SpeculativeDecoder
    decoder = SpeculativeDecoder(target, draft, static_ids=torch.arange(32768))
    prompt = [(31 * i + 7) % target.cfg.vocab_size for i in range(64)]
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    acceptance = measured_acceptance()
    rows = []
    for method in METHODS:
        for tree in (CHAIN,) if method == "ar" else (CHAIN, TREE):
            shape = "none" if method == "ar" else tree.shape
            replay = ReplayedAcceptance(acceptance.get(ARMS[(method, shape)], []))
            with replayed(replay):
                rows.append({"method": method, "tree": shape, "replayed_acceptance": replay.by_depth,
                             "expected_tau": round(replay.expected_tau(0 if method == "ar" else tree.levels), 4),
                             **timed_generation(decoder, prompt, sampling, SpecParams(method=method, tree=tree))})
    return {"max_tokens": max_tokens, "chain": CHAIN.model_dump(), "tree": TREE.model_dump(),
            "acceptance_source": str(ACCEPTANCE_RESULTS), "rows": rows}


def timed_generation(decoder, prompt: list[int], sampling: SamplingParams, spec: SpecParams) -> dict:
    """One generation after an untimed one (first calls choose kernels), timed to the device's end."""
    list(decoder.generate(prompt, sampling, spec))
    device = decoder.target.device
    synchronize(device)
    t0 = time.perf_counter()
    gen = decoder.generate(prompt, sampling, spec)
    list(gen)
    synchronize(device)
    seconds = time.perf_counter() - t0
    return {"ms_per_step": round(1000 * seconds / max(1, gen.stats.steps), 3), "steps": gen.stats.steps,
            "tokens": len(gen.output_ids), "tau": round(gen.stats.tau, 3),
            "tokens_per_s": round(len(gen.output_ids) / seconds, 2)}


def verify_syncs(device: torch.device) -> dict:
    """Host synchronisations of one batched verify step (8 requests, greedy and sampled, trees of up to 8 nodes) and
    of that step's vocabulary feedback (8 requests), counted by CUDA's sync debug mode (each synchronising call
    warns)."""
    if device.type != "cuda":
        return {"skipped": "no GPU: counted on the CPU by tests/unit/test_verify_batch.py and test_evospec.py"}
    from evospec.testing import feedback_step_syncs, verify_step_syncs
    results, _, syncs = verify_step_syncs(device)
    _, _, feedback = feedback_step_syncs(device)
    return {"per_step": len(syncs), "calls": syncs[:8], "requests": len(results),
            "feedback_per_step": len(feedback), "feedback_calls": feedback[:8]}


def decoupled(out: Path, cpu: bool) -> dict:
    """`evospec bench decoupled --full-trees` on the tiny pair, draft and target sharing this device (a few minutes on
    a GPU; one short cell with --cpu, so the path never rots). Through Ray Serve where Ray is installed; else (the GPU
    image: Ray's wheel is over what a device run can carry) `--transport local`, the same speculation stream."""
    import importlib.util
    # With --cpu: local always (the service through Serve on a CPU is tests/e2e's and bench decoupled's).
    transport = "local" if cpu or importlib.util.find_spec("ray") is None else "serve"
    size = (["--repeats", "1", "--prompts", "1", "--max-tokens", "12", "--concurrency", "1", "--methods", "evospec"]
            if cpu else ["--repeats", "2", "--prompts", "2", "--max-tokens", "32", "--concurrency", "1", "4"])
    config = "orchestration/configs/" + ("cpu-tiny.yaml" if cpu else "gpu-tiny.yaml")
    bench_args = ["--pair", "tiny", "--config", config, "--transport", transport,
                  "--full-trees", "--breakdown", *size, "--out", str(out / "decoupled")]
    proc = subprocess.run([sys.executable, "-c", f"from evospec.bench.decoupled import main; main({bench_args!r})"],
                          capture_output=True, text=True, timeout=360)
    result = {"rc": proc.returncode, "transport": transport,
              "json": str(out / "decoupled" / "bench_decoupled.json")}
    if proc.returncode != 0:
        result["error"] = (proc.stderr or proc.stdout)[-2000:]
    return result


def write(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# gpu_check ({report['mode']})", "",
             f"{env.get('device')} · torch {env['torch']} · CPU {env['cpu']} · "
             f"{report['elapsed_s']} s", "",
             f"- tests/gpu: {report['tests_gpu'].get('summary', report['tests_gpu'].get('error'))}",
             f"- verify host syncs per step: {report['verify_host_syncs']}", ""]
    forward = report.get("forward_ms", {})
    if "target" in forward:
        lines += [f"## Forward ms (context {forward['target']['context']}, full LM head)", "",
                  "| model | " + " | ".join(f"{n} tok" for n in forward["target"]["by_new_tokens"]) + " |",
                  "|---" * (1 + len(forward["target"]["by_new_tokens"])) + "|"]
        for role in ("target", "draft"):
            lines.append(f"| {role} | " + " | ".join(f"{v:.2f}" for v in forward[role]["by_new_tokens"].values())
                         + " |")
        lines += ["", "| model | " + " | ".join(f"batch {b}" for b in forward["target"]["by_batch"]) + " |",
                  "|---" * (1 + len(forward["target"]["by_batch"])) + "|"]
        for role in ("target", "draft"):
            lines.append(f"| {role} | " + " | ".join(f"{v:.2f}" for v in forward[role]["by_batch"].values()) + " |")
        lines.append("")
    engine = report.get("engine_ms_per_step", {})
    if "rows" in engine:
        lines += ["## Engine steps (in process, one request, fixed trees, the real pair's acceptance replayed)", "",
                  "| method | tree | ms/step | τ | tok/s |", "|---|---|---|---|---|"]
        lines += [f"| {r['method']} | {r['tree']} | {r['ms_per_step']:.2f} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} |"
                  for r in engine["rows"]]
        lines.append("")
    errors = {k: v["error"] for k, v in report.items() if isinstance(v, dict) and "error" in v}
    if errors:
        lines += ["## Failed steps", ""] + [f"- {k}: {v.splitlines()[0] if v else v}" for k, v in errors.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
