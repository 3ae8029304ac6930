"""scripts/gpu_check.sh --cpu (the GPU check's steps on tiny models, so the script never rots before a GPU is lent)
and the projection that reads its JSON (bench/projection.py `from_gpu_check`)."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from evospec.bench.projection import ARMS, from_gpu_check, interpolate

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--cpu"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OUT": str(out)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "gpu_check.md").read_text().startswith("# gpu_check (cpu)")
    return json.loads((out / "gpu_check.json").read_text())


@pytest.mark.process
def test_the_cpu_check_runs_every_step_in_a_minute(check):
    assert check["mode"] == "cpu" and check["elapsed_s"] < 60, check["elapsed_s"]
    assert not [k for k, v in check.items() if isinstance(v, dict) and "error" in v]
    assert "skipped" in check["tests_gpu"]["summary"]  # tests/gpu collected (and skipped without CUDA)
    for role in ("target", "draft"):
        assert set(check["forward_ms"][role]["by_new_tokens"]) == {"1", "2", "4", "8", "16", "32", "64"}
        assert all(ms > 0 for ms in check["forward_ms"][role]["by_batch"].values())
    arms = {(r["method"], r["tree"]) for r in check["engine_ms_per_step"]["rows"]}
    assert arms == set(ARMS)
    assert all(r["steps"] > 0 and r["tokens"] == check["engine_ms_per_step"]["max_tokens"]
               for r in check["engine_ms_per_step"]["rows"])


@pytest.mark.process
def test_engine_steps_commit_the_replayed_acceptance(check):
    """Random weights accept almost nothing; with the real pair's rates replayed a speculative step commits more
    than one token, and a tree (two candidates per level) more than its chain."""
    rows = {(r["method"], r["tree"]): r for r in check["engine_ms_per_step"]["rows"]}
    assert rows[("ar", "none")]["tau"] == 1.0
    speculative = [row for (method, _), row in rows.items() if method != "ar"]
    assert all(row["replayed_acceptance"] and row["tau"] > 1.1 and row["expected_tau"] > 2 for row in speculative)
    # each run is a few steps long (16 tokens): their τ together, not one by one, is near the expectation
    mean_tau = sum(r["tokens"] for r in speculative) / sum(r["steps"] for r in speculative)
    assert mean_tau > 1.8, [(r["method"], r["tree"], r["tau"]) for r in speculative]


@pytest.mark.process
def test_the_decoupled_step_runs_the_draft_in_its_own_process_and_matches_in_process(check):
    result = check["decoupled"]
    assert result["rc"] == 0 and result["transport"] == "local"
    report = json.loads(Path(result["json"]).read_text())
    assert report["mismatches"] and not any(report["mismatches"].values())  # greedy: identical tokens
    remote = [p for name, runs in report["profiles"].items() if name.startswith("decoupled") for p in runs]
    assert remote and all(p["seconds"].get("draft.remote_compute", 0) > 0 for p in remote)  # the replica drafted


@pytest.mark.process
def test_the_projection_reads_the_check_and_says_what_was_measured_where(check):
    table = from_gpu_check(check)
    assert {r["arm"] for r in table["rows"]} == set(ARMS.values())
    ar = next(r for r in table["rows"] if r["arm"] == "ar")
    assert ar["colocated_vs_ar"] == 1.0 and ar["tau"] == 1.0
    evospec = next(r for r in table["rows"] if r["arm"] == "evospec-32k+256")
    assert evospec["decoupled_ms"] > ar["decoupled_ms"]  # a drafting step pays the draft and the transport
    assert "not a GPU figure" in table["inputs"]["forward and engine step costs"]
    assert "bench decoupled's profiles on cpu" in table["inputs"]["transport per step"]
    assert "results/acceptance_real" in table["inputs"]["tau per arm"]


def test_interpolation_between_and_beyond_measured_sizes():
    table = {"1": 2.0, "4": 5.0, "8": 9.0}
    assert interpolate(table, 1) == 2.0 and interpolate(table, 2) == 3.0 and interpolate(table, 6) == 7.0
    assert interpolate(table, 12) == 13.0 and interpolate(table, 0) == 2.0


@pytest.mark.parametrize("argv,option", [(["--gpu-check", "/nonexistent/gpu_check.json"], "--gpu-check"),
                                         (["--hit", "1.5"], "--hit"), (["--hit", "-0.1"], "--hit")])
def test_projection_refuses_bad_options_naming_them(argv, option, capsys):
    from evospec.bench.projection import main
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and option in capsys.readouterr().err
