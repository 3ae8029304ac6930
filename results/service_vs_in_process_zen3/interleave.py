# A probe, not a bench command: run from the repository root with PYTHONPATH=. (imports bench.service and loadtest).
"""ar through the service and ar in this process (the same Scheduler over the same target), taking turns per prompt."""
import asyncio
import statistics
import sys

import openai

from bench.service import in_process_ar_scheduler, start_service, timed_ar
from evospec.config import SamplingParams
from evospec.datasets import REALISTIC_PROMPT_SETS
from evospec.engine.runner import SchedulerThread
from evospec.orchestration.config import AppConfig
from evospec.orchestration.local import local_ray
from loadtest.datasets import build_requests
from loadtest.run import one_openai_request

cfg = AppConfig.from_yaml("orchestration/configs/cpu-qwen2.5-coder.yaml")
scheduler, _, tokenizer = in_process_ar_scheduler(cfg)
runner = SchedulerThread(scheduler).start()
n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
sets = {name: build_requests(REALISTIC_PROMPT_SETS[name](n, 0)[:n], 64, None, 0) for name in ("medical-rag", "code")}

def tok_s(r):
    return (r.output_tokens - 1) / (r.e2el - r.ttft) if r.ok and r.output_tokens > 1 else float("nan")

with local_ray(num_cpus=4):
    ctx, base_url, info, startup = start_service(cfg, "openai", 900)
    try:
        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", timeout=900)
        model_name = cfg.target.public.served_model_name
        warm = sets["code"][0]
        asyncio.run(one_openai_request(client, warm, {"method": "ar"}, 900, model_name))
        timed_ar(scheduler, tokenizer, warm.messages, SamplingParams(max_tokens=64), 900)
        out = {"in process": [], "service": []}
        for name, reqs in sets.items():
            for i, req in enumerate(reqs):
                order = ("in process", "service") if i % 2 == 0 else ("service", "in process")
                for arm in order:
                    if arm == "service":
                        r = asyncio.run(one_openai_request(openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", timeout=900), req, {"method": "ar"}, 900, model_name))
                    else:
                        r = timed_ar(scheduler, tokenizer, req.messages, SamplingParams(max_tokens=req.max_tokens), 900)
                    out[arm].append(tok_s(r))
                    print(f"{name} {i} {arm:10s} decode {tok_s(r):5.1f} tok/s ({r.output_tokens} tokens, ttft {r.ttft:.2f} s)", flush=True)
        for arm, v in out.items():
            print(arm, "median", round(statistics.median(v), 2), "min", round(min(v), 2), "max", round(max(v), 2))
        ratios = [s / p for s, p in zip(out["service"], out["in process"])]
        print("service / in process per prompt:", [round(x, 3) for x in ratios], "median", round(statistics.median(ratios), 3))
    finally:
        ctx.__exit__(None, None, None)
        runner.stop()
