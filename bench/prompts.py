"""Benchmark prompt sets: medical (held-out PubMedQA questions), general (Spec-Bench), topic-switch (both)."""
from __future__ import annotations

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


def topic_switch_prompts(n: int) -> list[list[dict]]:
    """One conversation per prompt that moves general -> medical -> general: earlier turns (with the medical
    abstract as an assistant answer) put long-tail medical tokens into the context the draft sees."""
    _, held = split_pubmedqa()
    general = general_prompts(2 * n)
    convs = []
    for k in range(n):
        item = held[-1 - k]
        convs.append([general[2 * k][0], {"role": "assistant", "content": " ".join(item["contexts"])[:1200]},
                      {"role": "user", "content": item["question"]}, {"role": "assistant", "content": item["answer"]},
                      general[2 * k + 1][0]])
    return convs


PROMPT_SETS = {"medical": medical_prompts, "general": general_prompts, "topic-switch": topic_switch_prompts}
