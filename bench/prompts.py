"""Benchmark prompt sets: medical (held-out PubMedQA questions), code (stdlib docstrings as requests), general
(Spec-Bench), topic-switch (medical -> code -> medical in one conversation)."""
from __future__ import annotations

import importlib
import inspect

from evospec.datasets import spec_bench_prompts, split_pubmedqa


def medical_prompts(n: int) -> list[list[dict]]:
    """Held-out PubMedQA questions (never seen in tiny-pair training) as single-turn chats."""
    _, held = split_pubmedqa()
    return [[{"role": "user", "content": it["question"]}] for it in held[:n]]


def general_prompts(n: int) -> list[list[dict]]:
    """Spec-Bench first turns, round-robin over categories so every kind of task is represented."""
    rows = spec_bench_prompts()
    by_cat: dict[str, list[dict]] = {}
    for r in rows:
        by_cat.setdefault(r["category"], []).append(r)
    picked, i = [], 0
    while len(picked) < n:
        for cat in sorted(by_cat):
            if i < len(by_cat[cat]) and len(picked) < n:
                picked.append([{"role": "user", "content": by_cat[cat][i]["prompt"]}])
        i += 1
    return picked


# Pure-Python stdlib modules whose public functions carry docstrings: the code set's source (it ships with Python,
# so nothing is downloaded; the prompts follow the running Python version's docstrings).
CODE_MODULES = ("textwrap", "statistics", "bisect", "heapq", "fnmatch", "shlex", "colorsys", "calendar", "difflib",
                "posixpath", "base64", "html", "glob", "random", "ipaddress", "fractions", "string", "json")


def stdlib_functions() -> list:
    """Public functions with a docstring of at least 60 characters, round-robin over CODE_MODULES (so the first n come
    from different modules), each module's functions in name order."""
    per_module = []
    for name in CODE_MODULES:
        module = importlib.import_module(name)
        per_module.append([fn for fname, fn in sorted(vars(module).items())
                           if inspect.isfunction(fn) and fn.__module__ == name and not fname.startswith("_")
                           and len(inspect.getdoc(fn) or "") >= 60])
    return [fns[i] for i in range(max(map(len, per_module))) for fns in per_module if i < len(fns)]


def code_request(fn) -> str:
    return (f"Write a Python function `{fn.__name__}{inspect.signature(fn)}` that does the following.\n\n"
            f"{inspect.getdoc(fn)}\n\nReply with the code only.")


def code_prompts(n: int) -> list[list[dict]]:
    """"Write this function" requests built from Python's own stdlib docstrings."""
    return [[{"role": "user", "content": code_request(fn)}] for fn in stdlib_functions()[:n]]


def topic_switch_prompts(n: int) -> list[list[dict]]:
    """One conversation per prompt that moves medical -> code -> medical: a held-out PubMedQA question with its
    answer, a stdlib "write this function" request answered with the function's real source, then another held-out
    medical question, which the model answers. The draft's buffer starts from a context full of both domains."""
    _, held = split_pubmedqa()
    functions = stdlib_functions()
    convs = []
    for k in range(n):
        first, last, fn = held[-1 - k], held[-1 - n - k], functions[-1 - k]
        convs.append([{"role": "user", "content": first["question"]},
                      {"role": "assistant", "content": first["answer"]},
                      {"role": "user", "content": code_request(fn)},
                      {"role": "assistant", "content": inspect.getsource(fn)[:1500]},
                      {"role": "user", "content": last["question"]}])
    return convs


PROMPT_SETS = {"medical": medical_prompts, "code": code_prompts, "general": general_prompts,
               "topic-switch": topic_switch_prompts}
