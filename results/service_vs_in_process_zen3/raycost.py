# A probe: the in-process engine (3 code prompts, ar, 64 tokens) with no Ray, with a Ray cluster, with the service up and idle; PYTHONPATH=. from the repository root.
import statistics
import time

from bench.service import in_process_ar_scheduler, start_service, timed_ar
from evospec.config import SamplingParams
from evospec.datasets import REALISTIC_PROMPT_SETS
from evospec.engine.runner import SchedulerThread
from evospec.orchestration.config import AppConfig
from evospec.orchestration.local import local_ray

cfg = AppConfig.from_yaml("orchestration/configs/cpu-qwen2.5-coder.yaml")
scheduler, _, tokenizer = in_process_ar_scheduler(cfg)
runner = SchedulerThread(scheduler).start()
convs = REALISTIC_PROMPT_SETS["code"](3, 0)[:3]
def phase(label):
    ms = []
    for messages in convs:
        r = timed_ar(scheduler, tokenizer, messages, SamplingParams(max_tokens=64), 600)
        ms.append((r.e2el - r.ttft) / (r.output_tokens - 1) * 1000)
    print(label, [round(x, 1) for x in ms], "median", round(statistics.median(ms), 1), flush=True)
phase("no Ray")
with local_ray(num_cpus=4):
    phase("Ray cluster up, no app")
    ctx, base_url, info, startup = start_service(cfg, "openai", 600)
    try:
        time.sleep(5)
        phase("Ray + service up, idle")
        phase("Ray + service up, idle")
    finally:
        ctx.__exit__(None, None, None)
    phase("Ray up, app deleted")
phase("no Ray again")
runner.stop()
