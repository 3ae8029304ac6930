"""evospec bench identity's comparison (bench/identity.py): the parts that need no service."""
from __future__ import annotations

import pytest

from evospec.bench.identity import compare, divergence, markdown, parse_args


def _answer(tokens: list[int], drafted: int = 0, accepted: int = 0) -> dict:
    return {"token_ids": tokens, "finish_reason": "length", "drafted": drafted, "accepted": accepted}


def test_divergence_names_the_first_differing_token():
    assert divergence([1, 2, 3], [1, 2, 3]) is None
    assert divergence([1, 2, 3], [1, 5, 3]) == 1
    assert divergence([1, 2], [1, 2, 3]) == 2  # a prefix: diverges where the shorter one ends


def test_compare_counts_identical_answers_per_method_and_set():
    results = {"ar": {"code": [_answer([1, 2, 3]), _answer([4, 5])]},
               "evospec": {"code": [_answer([1, 2, 3], 6, 4), _answer([4, 6], 2, 1)]}}
    (row,) = compare(results)
    assert row == {"method": "evospec", "set": "code", "requests": 2, "identical": 1, "first_divergence": [1],
                   "drafted": 8, "accepted": 5}
    report = {"meta": {"config": "x.yaml", "environment": {"cpu": "cpu"}, "info": {}, "max_tokens": 3,
                       "concurrency": 1, "every_step_drafts": True}, "rows": [row]}
    assert "| evospec | code | 1 / 2 | 1 | 8 | 5 |" in markdown(report)


def test_bad_counts_are_refused_naming_the_options():
    with pytest.raises(SystemExit):
        parse_args(["--concurrency", "0"])
