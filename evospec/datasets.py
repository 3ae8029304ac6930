"""Text corpora from ../shared/data (PubMedQA, Spec-Bench) and two public-domain PyPI packages (ICD-10-CM, KJV).

Used by the tiny-pair trainer, the co-occurrence index, the benchmarks' prompt sets, the load tests and the soak.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

HELD_OUT_PUBMEDQA = 60  # the last N PubMedQA items (by PubMed id) never enter training: benchmark prompts come from them


def shared_data_dir() -> Path:
    """`$EVOSPEC_DATA_DIR`, else ../shared/data beside the checkout."""
    env = os.environ.get("EVOSPEC_DATA_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "shared" / "data"


def pubmedqa_items(data_dir: Path | None = None) -> list[dict]:
    """PubMedQA items sorted by PubMed id: {'id', 'question', 'contexts': [str], 'answer'}."""
    path = (data_dir or shared_data_dir()) / "pubmedqa" / "pqal_900.json"
    raw = json.loads(path.read_text())
    items = []
    for pmid in sorted(raw):
        item = raw[pmid]
        contexts = item["CONTEXTS"]
        if isinstance(contexts, str):  # some dumps store the list as its repr
            import ast
            contexts = ast.literal_eval(contexts)
        items.append({"id": pmid, "question": item["QUESTION"], "contexts": list(contexts),
                      "answer": item["LONG_ANSWER"]})
    return items


def split_pubmedqa(data_dir: Path | None = None) -> tuple[list[dict], list[dict]]:
    items = pubmedqa_items(data_dir)
    return items[:-HELD_OUT_PUBMEDQA], items[-HELD_OUT_PUBMEDQA:]


def spec_bench_prompts(data_dir: Path | None = None) -> list[dict]:
    """Spec-Bench rows: {'id', 'category', 'prompt'} (first turn)."""
    path = (data_dir or shared_data_dir()) / "spec_bench" / "question.jsonl"
    rows = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        rows.append({"id": row["question_id"], "category": row["category"], "prompt": row["turns"][0],
                     "turns": row["turns"]})
    return rows


def load_prompts(dataset: str, num_prompts: int, seed: int, path: str | None = None) -> list[list[dict]]:
    """`num_prompts` chats drawn with replacement (seeded) from a dataset: medical (PubMedQA questions), spec-bench
    (first turns), or jsonl (your file at `path`: {"prompt": ...} or {"messages": [...]} per line)."""
    if dataset == "medical":
        items = [[{"role": "user", "content": it["question"]}] for it in pubmedqa_items()]
    elif dataset == "spec-bench":
        items = [[{"role": "user", "content": r["prompt"]}] for r in spec_bench_prompts()]
    elif dataset == "jsonl":
        if not path:
            raise ValueError("--dataset jsonl needs --dataset-path")
        items = []
        for line in Path(path).read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                items.append(row.get("messages") or [{"role": "user", "content": row["prompt"]}])
    else:
        raise ValueError(f"unknown dataset {dataset!r}: medical, spec-bench or jsonl")
    rng = random.Random(seed)
    return [items[rng.randrange(len(items))] for _ in range(num_prompts)]


def kjv_verses(limit: int | None = None) -> list[str]:
    import importlib.util
    spec = importlib.util.find_spec("bible")
    if spec is None or spec.origin is None:
        return []
    path = Path(spec.origin).parent / "data" / "kjv.jsonl"
    verses = []
    with path.open() as f:
        for line in f:
            verses.append(json.loads(line)["text"])
            if limit and len(verses) >= limit:
                break
    return verses


def icd10_descriptions(limit: int | None = None) -> list[str]:
    try:
        import simple_icd_10_cm as icd
    except ImportError:
        return []
    codes = icd.get_all_codes(with_dots=True)
    if limit:
        codes = codes[:: max(1, len(codes) // limit)][:limit]
    return [f"{c}: {icd.get_description(c)}" for c in codes]


def medical_chat(item: dict) -> list[dict]:
    return [{"role": "user", "content": item["question"]}, {"role": "assistant", "content": item["answer"]}]
