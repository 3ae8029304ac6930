"""`evospec bench service`: its pure parts (oracle choice, ratios, options, tables, the realistic prompt sets), and the
whole command on the tiny pair with a minimal grid (marked e2e: it starts a private Ray cluster and two services)."""
import json
import os
import secrets
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from evospec.bench.service import (
    IN_PROCESS,
    add_ratios,
    cell_summary,
    choose_oracle,
    fixed_depth_options,
    markdown,
    oracle_rows,
    request_options,
    request_rows,
    requests_per_cell,
)
from evospec.config import TreeParams
from evospec.datasets import (
    CODE_STUB_MODULES,
    FOLLOW_UPS,
    REALISTIC_PROMPT_SETS,
    chat_prompts,
    code_stub_prompts,
    load_prompts,
    medical_rag_prompts,
    split_pubmedqa,
)
from evospec.loadtest.run import RequestResult
from evospec.orchestration.config import CONFIG_DIR

ROOT = Path(__file__).resolve().parents[2]


# ---- pure functions ---------------------------------------------------------------------------------------------

def summary(tok_s: float, completed: int = 2, **extra) -> dict:
    return {"tok_s": tok_s, "completed": completed, "failed": 0, "errors": {}, "per_request_tok_s": tok_s / 2,
            "ttft_p50_ms": 100.0, "ttft_p90_ms": 150.0, "tpot_p50_ms": 20.0, "tpot_p90_ms": 30.0, "tau": 1.5,
            "mean_depth": 2.0, "prompt_tokens": {"min": 300, "median": 400, "max": 500}, "tok_s_runs": [tok_s],
            **extra}


def row(arm: str, c: int, tok_s: float, **extra) -> dict:
    return {"arm": arm, "set": "medical-rag", "temperature": 0.0, "concurrency": c, **summary(tok_s, **extra)}


def test_oracle_is_the_best_candidate_that_completed():
    assert choose_oracle({"ar": summary(5.0), "fixed-d1": summary(7.0), "fixed-d2": summary(6.0)})[0] == "fixed-d1"
    assert choose_oracle({"ar": summary(5.0), "fixed-d1": summary(9.0, completed=0)})[0] == "ar"
    assert choose_oracle({"fixed-d1": summary(9.0, completed=0)}) is None


def test_oracle_rows_and_ratios_per_cell():
    rows = [row("ar", 1, 10.0), row("evospec", 1, 12.0), row("ar", 2, 16.0), row("evospec", 2, 15.0)]
    candidates = [row("fixed-d1", 1, 13.0), row("fixed-d2", 1, 14.0), row("fixed-d1", 2, 15.5),
                  row("fixed-d2", 2, 11.0)]
    rows += oracle_rows(rows, candidates)
    add_ratios(rows)
    oracle = {r["concurrency"]: r for r in rows if r["arm"] == "oracle"}
    assert (oracle[1]["oracle_choice"], oracle[1]["oracle_depth"], oracle[1]["tok_s"]) == ("fixed-d2", 2, 14.0)
    assert (oracle[2]["oracle_choice"], oracle[2]["oracle_depth"], oracle[2]["tok_s"]) == ("ar", 0, 16.0)
    assert oracle[1]["oracle_candidates"] == {"ar": 10.0, "fixed-d1": 13.0, "fixed-d2": 14.0}
    by = {(r["arm"], r["concurrency"]): r for r in rows}
    assert by[("evospec", 1)]["vs_ar"] == 1.2 and by[("evospec", 1)]["vs_oracle"] == pytest.approx(12 / 14, abs=1e-3)
    assert by[("ar", 2)]["vs_oracle"] == 1.0 and by[("oracle", 2)]["vs_ar"] == 1.0


def test_fixed_depth_options_cut_the_default_shape():
    chain = TreeParams()
    assert fixed_depth_options(chain, 2) == {"shape": "chain", "num_draft_tokens": 2}
    assert fixed_depth_options(chain, 6) == {"shape": "chain", "num_draft_tokens": 6}  # deeper: lengthened
    tree = TreeParams(shape="tree", depth=4, branching=2, budget=8)
    assert fixed_depth_options(tree, 1) == {"shape": "tree", "depth": 1, "budget": 2}
    assert fixed_depth_options(tree, 2) == {"shape": "tree", "depth": 2, "budget": 6}
    assert fixed_depth_options(tree, 4) == {"shape": "tree", "depth": 4, "budget": 8}


def test_sampled_requests_carry_the_seed_and_cells_scale_with_concurrency():
    assert request_options({"method": "ar"}, 0.0, 7, "grpc") == {"method": "ar"}
    assert request_options({"method": "ar"}, 0.7, 7, "grpc") == {"method": "ar", "seed": 7}
    assert request_options({"method": "ar"}, 0.7, 7, "openai") == {"method": "ar"}  # `speculation` holds no seed
    assert [requests_per_cell(c, 2) for c in (1, 2, 16)] == [2, 4, 32]


def test_cell_summary_adds_per_request_speed_depth_and_prompt_lengths():
    results = [RequestResult(ok=True, max_tokens=8, output_tokens=8, ttft=0.5, e2el=2.0, finish_reason="length",
                             stats={"steps": 4, "accepted": 4, "drafted": 8, "drafted_levels": 8,
                                    "prompt_tokens": 300}),
               RequestResult(ok=True, max_tokens=8, output_tokens=8, ttft=1.0, e2el=4.0, finish_reason="length",
                             stats={"steps": 8, "accepted": 0, "drafted": 0, "drafted_levels": 0,
                                    "prompt_tokens": 500}),
               RequestResult(ok=False, max_tokens=8, error="UNAVAILABLE")]
    s = cell_summary(results, duration=4.0)
    assert (s["requests"], s["completed"], s["failed"], s["errors"]) == (3, 2, 1, {"UNAVAILABLE": 1})
    assert s["tok_s"] == 4.0 and s["per_request_tok_s"] == 3.0
    assert s["mean_depth"] == pytest.approx(8 / 12, abs=1e-3) and s["tau"] == pytest.approx(1 + 4 / 12, abs=1e-3)
    assert s["prompt_tokens"] == {"min": 300, "median": 400.0, "max": 500}
    rows = request_rows(results[:2], arm="evospec")
    assert [(r["drafted"], r["draft_seconds"]) for r in rows] == [(8, None), (0, None)]
    timed = RequestResult(ok=True, max_tokens=8, stats={"steps": 2, "drafted": 3, "draft_seconds": 0.25})
    assert request_rows([timed])[0]["draft_seconds"] == 0.25


def test_markdown_has_one_table_per_set_and_temperature_with_the_oracle_winner():
    rows = [row("ar", 1, 10.0), row("evospec", 1, 12.0), row(IN_PROCESS, 1, 11.0),
            {**row("ar", 1, 8.0), "temperature": 0.7}]
    rows += oracle_rows(rows, [row("fixed-d1", 1, 13.0), row("fixed-d2", 1, 9.0)])
    add_ratios(rows)
    report = {"meta": {"config": "cpu-tiny.yaml", "oracle_depths": [1, 2],
                       "args": {"api": "grpc", "max_tokens": 4, "requests_per_cell": 1, "repeats": 1},
                       "environment": {"cpu": "Some CPU (AVX2, no native bf16)", "cpu_capability": "AVX2",
                                       "cpu_flags": {"avx2": True, "avx512f": False}, "cpu_count": 2,
                                       "git": {"commit": "0123456789abcdef", "dirty": False}}},
              "services": {"main": {"startup_s": 20.0, "info": {"target_model": "t", "draft_model": "d"}}},
              "rows": rows}
    md = markdown(report)
    assert "## medical-rag, T=0\n" in md and "## medical-rag, T=0.7\n" in md
    assert "| oracle (fixed-d1) | 1 | 13 (13) |" in md and "| **13** | 9 |" in md
    assert f"| {IN_PROCESS} | 1 | 11 (11) |" in md and "Some CPU" in md and "flags avx2" in md
    table = md.split("## medical-rag, T=0\n")[1].split("##")[0]
    arms = [line.split(" | ")[0].lstrip("| ") for line in table.splitlines()
            if line.startswith("| ") and "|---" not in line]
    assert arms[1:5] == ["ar", "evospec", "oracle (fixed-d1)", IN_PROCESS]  # header first, then the arm order


# ---- the realistic prompt sets (no tokenizer: ~4 characters per token in this text) ---------------------------------

def test_medical_rag_prompts_are_held_out_contexts_then_the_question():
    _, held = split_pubmedqa()
    by_question = {it["question"]: it for it in held}
    convs = medical_rag_prompts(None, 0)
    assert len(convs) == len(held) and all(len(c) == 1 and c[0]["role"] == "user" for c in convs)
    for conv in convs:
        text = conv[0]["content"]
        question = text.rsplit("Question: ", 1)[1]
        assert question in by_question and "Context:\n[1] " in text and "cite" in text
        assert by_question[question]["contexts"][0].strip() in text
    chars = [len(c[0]["content"]) for c in convs]
    assert 700 <= min(chars) and max(chars) <= 3500  # ~190-670 tokens with the chat template
    assert 1200 <= statistics.median(chars) <= 2200  # median ~390 tokens
    assert medical_rag_prompts(5, 0) == convs[:5] and medical_rag_prompts(5, 1) != convs[:5]
    assert medical_rag_prompts(len(held) + 2, 0)[-2:] == convs[:2]  # cycles past the set


def test_code_prompts_are_stdlib_stubs_to_complete():
    convs = code_stub_prompts(None, 0)
    texts = [c[0]["content"] for c in convs]
    assert len(texts) >= 100 and len(set(texts)) == len(texts)
    for text in texts:
        assert text.startswith("Complete the body of this function") and "def " in text and '"""' in text
        assert text.split("# module: ", 1)[1].split("\n", 1)[0] in CODE_STUB_MODULES
    assert len({t.split("# module: ", 1)[1].split("\n", 1)[0] for t in texts[:10]}) >= 4  # a prefix mixes modules
    assert code_stub_prompts(8, 3) == code_stub_prompts(8, 3) != code_stub_prompts(8, 4)
    assert all(200 <= len(t) <= 3000 for t in texts)


def test_chat_prompts_are_question_answer_follow_up():
    _, held = split_pubmedqa()
    answers = {it["question"]: it["answer"] for it in held}
    convs = chat_prompts(20, 0)
    for conv in convs:
        assert [m["role"] for m in conv] == ["user", "assistant", "user"]
        assert answers[conv[0]["content"]] == conv[1]["content"] and conv[2]["content"] in FOLLOW_UPS
    assert len({c[2]["content"] for c in convs}) > 1 and chat_prompts(20, 0) == convs


def test_load_prompts_selects_the_realistic_sets_by_name():
    for name in REALISTIC_PROMPT_SETS:
        drawn = load_prompts(name, 5, 0)
        every = REALISTIC_PROMPT_SETS[name](None, 0)
        assert len(drawn) == 5 and all(conv in every for conv in drawn)


# ---- the whole command ------------------------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.nightly  # a Ray cluster and two services of its own: the full tier only (one Serve app per CI run)
@pytest.mark.timeout(400)
def test_bench_service_on_the_tiny_pair_writes_sane_results(tmp_path):
    # Ray token authentication with a token of this run's own (as tests/e2e/test_serve_cli.py): never ~/.ray's.
    token = tmp_path / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN_PATH": str(token)}
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "evospec.orchestration.cli", "bench", "service",
           "--config", str(CONFIG_DIR / "cpu-tiny.yaml"), "--concurrency", "1", "2", "--temperatures", "0",
           "--sets", "medical-rag", "--max-tokens", "4", "--oracle-depths", "1", "2", "--requests-per-cell", "1",
           "--timeout", "300", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "main cell 2/2" in proc.stdout and "oracle cell 2/2" in proc.stdout  # progress per cell
    for name in ("service.json", "service.md", "throughput.png", "ttft.png"):
        assert (out / name).stat().st_size > 0, name
    report = json.loads((out / "service.json").read_text())
    env_meta = report["meta"]["environment"]
    assert env_meta["cpu"] and env_meta["cpu_capability"] and "avx2" in env_meta["cpu_flags"]
    assert len(env_meta["git"]["commit"]) == 40 and env_meta["torch_threads_driver"] >= 1
    assert report["meta"]["oracle_depths"] == [1, 2]
    services = report["services"]
    assert services["main"]["startup_s"] > 0 and services["oracle"]["startup_s"] > 0
    assert services["oracle"]["config"]["target"]["scheduler"]["adaptive"] is False
    assert services["main"]["config"]["target"]["scheduler"]["adaptive"] is True
    assert "secret" not in services["main"]["config"]["draft"]["internal"]
    rows = {(r["arm"], r["concurrency"]): r for r in report["rows"]}
    assert set(rows) == {(a, c) for a in ("ar", "frspec", "evospec", "lookup", "oracle") for c in (1, 2)} | {(IN_PROCESS, 1)}
    for r in report["rows"]:
        assert r["failed"] == 0 and r["completed"] == r["requests"] and r["tok_s"] > 0, r
        assert r["vs_ar"] is not None and r["vs_oracle"] is not None and r["ttft_p50_ms"] > 0
        assert 1 <= r["prompt_tokens"]["min"] and r["prompt_tokens"]["max"] <= 800
    assert rows[("ar", 1)]["tau"] == 1.0 and rows[("ar", 1)]["mean_depth"] == 0.0 and rows[("ar", 1)]["vs_ar"] == 1.0
    candidates = {(r["arm"], r["concurrency"]): r["tok_s"] for r in report["oracle_candidates"]}
    assert set(candidates) == {(f"fixed-d{d}", c) for d in (1, 2) for c in (1, 2)}
    for c in (1, 2):
        oracle = rows[("oracle", c)]
        best = max(rows[("ar", c)]["tok_s"], candidates[("fixed-d1", c)], candidates[("fixed-d2", c)])
        assert oracle["tok_s"] == best and oracle["oracle_choice"] in ("ar", "fixed-d1", "fixed-d2")
        assert all(rows[(a, c)]["vs_oracle"] <= 1.0 for a in ("ar", "oracle"))
    depth_rows = [r for r in report["requests"] if r["arm"].startswith("fixed-d")]
    assert depth_rows and all(r["ok"] and r["prompt_tokens"] for r in depth_rows)
    md = (out / "service.md").read_text()
    assert "## medical-rag, T=0" in md and "| oracle (" in md and env_meta["cpu"] in md
