"""Cost of decoupling: the same method and prompts in process vs through the service (Ray Serve + gRPC, draft and
target in separate replicas), interleaved in one run.

    evospec bench decoupled [--pair tiny|qwen2.5-coder] [--repeats 3] [--prompts 4] [--max-tokens 48]

Both sides load the models from the same service config (orchestration/configs/cpu-<pair>.yaml: paths, dtype,
quantization, static vocabulary). Reports tokens/s both ways, their ratio, and the added wall time per step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from evospec.bench.prompts import PROMPT_SETS
from evospec.config import METHODS, SamplingParams, SpecParams
from evospec.loading import apply_torch_threads, load_pair
from evospec.modelstore.catalog import pair_names
from evospec.tokenizer import chat_prompt_ids


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="tiny", choices=pair_names())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--out", type=Path, default=Path("results/bench_decoupled"))
    args = ap.parse_args(argv)
    from evospec.orchestration.config import AppConfig, config_for_pair
    from evospec.orchestration.local import free_port, local_service
    from evospec_client import EvoSpecClient

    cfg = AppConfig.from_yaml(config_for_pair(args.pair)).model_copy(
        update={"grpc_port": free_port(), "http_port": free_port()})
    apply_torch_threads(cfg.target.model.torch_threads)
    pair = load_pair(cfg.draft.model, cfg.target.model, static_vocab_path=cfg.target.static_vocab,
                     max_model_len=cfg.target.max_model_len, cooc_path=cfg.draft.cooc)
    convs = PROMPT_SETS["medical"](args.prompts)
    prompts = [chat_prompt_ids(pair.tokenizer, c) for c in convs]
    rows: dict[str, dict[str, list[float]]] = {m: {"local": [], "service": [], "step_ms": []} for m in args.methods}
    with local_service(cfg) as address, EvoSpecClient(address) as client:
        client.wait_ready()
        for rep in range(args.repeats + 1):  # repeat 0 warms both paths up and is not recorded
            for method in args.methods:
                spec = SpecParams(method=method)
                t0 = time.perf_counter()
                local_tokens = local_steps = 0
                for p in prompts:
                    gen = pair.decoder.generate(p, SamplingParams(max_tokens=args.max_tokens), spec)
                    list(gen)
                    local_tokens += len(gen.output_ids)
                    local_steps += gen.stats.steps
                t1 = time.perf_counter()
                remote_tokens = 0
                for c in convs:
                    remote_tokens += len(client.generate(messages=c, max_tokens=args.max_tokens,
                                                         method=method).token_ids)
                t2 = time.perf_counter()
                assert remote_tokens == local_tokens, "service and in-process outputs differ"
                if rep:
                    rows[method]["local"].append(local_tokens / (t1 - t0))
                    rows[method]["service"].append(remote_tokens / (t2 - t1))
                    rows[method]["step_ms"].append(1000 * ((t2 - t1) - (t1 - t0)) / local_steps)
    lines = ["| method | in-process tok/s | service tok/s | service / in-process | added ms per step |",
             "|---|---|---|---|---|"]
    med = statistics.median
    for m, r in rows.items():
        ratios = [s / loc for s, loc in zip(r["service"], r["local"])]
        lines.append(f"| {m} | {med(r['local']):.1f} | {med(r['service']):.1f} | {med(ratios):.3f} "
                     f"({min(ratios):.3f}–{max(ratios):.3f}) | {med(r['step_ms']):.2f} |")
    md = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_decoupled.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                               "rows": rows}, indent=1))
    (args.out / "bench_decoupled.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
