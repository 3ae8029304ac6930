"""Text corpora from ../shared/data (PubMedQA, Spec-Bench) and two public-domain PyPI packages (ICD-10-CM, KJV).

Used by the tiny-pair trainer, the co-occurrence index, the benchmarks' prompt sets, the load tests and the soak.
"""
from __future__ import annotations

import json
import os
import random
import re
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
    (first turns), the realistic sets medical-rag, code and chat (REALISTIC_PROMPT_SETS), or jsonl (your file at
    `path`: {"prompt": ...} or {"messages": [...]} per line)."""
    if dataset == "medical":
        items = [[{"role": "user", "content": it["question"]}] for it in pubmedqa_items()]
    elif dataset == "spec-bench":
        items = [[{"role": "user", "content": r["prompt"]}] for r in spec_bench_prompts()]
    elif dataset in REALISTIC_PROMPT_SETS:
        items = REALISTIC_PROMPT_SETS[dataset](None, seed)
    elif dataset == "jsonl":
        if not path:
            raise ValueError("--dataset jsonl needs --dataset-path")
        items = []
        for line in Path(path).read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                items.append(row.get("messages") or [{"role": "user", "content": row["prompt"]}])
    else:
        raise ValueError(f"unknown dataset {dataset!r}: medical, spec-bench, {', '.join(REALISTIC_PROMPT_SETS)} or "
                         f"jsonl")
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


# ---- realistic prompt sets: what users of the service send (`evospec bench service`) -----------------------------
# Each is `f(n, seed) -> n chats` (n None = every item once), deterministic for a seed: the items in a seeded order,
# cycled when n is larger than the set. medical-rag and chat use only held-out PubMedQA items (split_pubmedqa()[1]).

def _seeded_cycle(items: list, n: int | None, seed: int) -> list:
    order = list(items)
    random.Random(seed).shuffle(order)
    if n is None:
        return order
    return [order[i % len(order)] for i in range(n)]


RAG_INSTRUCTION = ("Answer the question using only the context below. Be brief (two to four sentences) and cite the "
                   "context passages you rely on by their numbers, e.g. [2].")


def medical_rag_prompts(n: int | None = None, seed: int = 0) -> list[list[dict]]:
    """Retrieval-augmented medical questions: a held-out PubMedQA item's contexts (its abstract's sections, numbered),
    then its question, asking for a brief answer that cites the context (about 200-650 tokens with a chat
    template, median ~400: the length of a question with its abstract)."""
    _, held = split_pubmedqa()

    def chat(item: dict) -> list[dict]:
        passages = "\n\n".join(f"[{i}] {text.strip()}" for i, text in enumerate(item["contexts"], 1))
        return [{"role": "user", "content": f"{RAG_INSTRUCTION}\n\nContext:\n{passages}\n\n"
                                            f"Question: {item['question']}"}]
    return [chat(it) for it in _seeded_cycle(held, n, seed)]


# Pure-Python standard-library modules (no C accelerator replaces their functions, so `inspect` sees the source's
# signatures and docstrings). The prompts follow the running Python version's docstrings.
CODE_STUB_MODULES = ("textwrap", "json.decoder", "json.encoder", "statistics", "fractions", "shlex", "difflib",
                     "fnmatch", "colorsys", "calendar", "string", "ipaddress", "base64", "html", "posixpath",
                     "glob", "configparser", "csv", "dataclasses", "email.utils", "gettext", "locale", "quopri",
                     "urllib.parse")
CODE_STUB_INSTRUCTION = "Complete the body of this function. Reply with the complete function in one Python code block."
MIN_DOCSTRING_CHARS = 60


def _own_doc(fn) -> str:
    import inspect
    return inspect.cleandoc(fn.__doc__) if fn.__doc__ else ""  # the function's own docstring, never an inherited one


def code_stubs() -> list[tuple[str, str | None, object]]:
    """(module, class name or None, function) for every public function and public method of a public class defined
    in CODE_STUB_MODULES with a docstring of at least MIN_DOCSTRING_CHARS, round-robin over the modules (each
    module's in name order), so any prefix mixes modules."""
    import importlib
    import inspect
    per_module = []
    for name in CODE_STUB_MODULES:
        module = importlib.import_module(name)
        found = []
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue
            if inspect.isfunction(obj):
                found.append((name, None, obj))
            elif inspect.isclass(obj):
                found += [(name, attr, fn) for fname, fn in sorted(vars(obj).items())
                          if inspect.isfunction(fn) and not fname.startswith("_")]
        per_module.append([entry for entry in found if len(_own_doc(entry[2])) >= MIN_DOCSTRING_CHARS])
    return [stubs[i] for i in range(max(map(len, per_module))) for stubs in per_module if i < len(stubs)]


def code_stub(module: str, cls: str | None, fn) -> str:
    """The stub of one function: its signature and docstring, the body left to the model (a method inside its
    class)."""
    import inspect
    import textwrap
    try:
        # a default's repr may carry its address (`<... object at 0x7f...>`): dropped, so a stub is the same text
        # in every process (prompts, calibration keys)
        signature = re.sub(r" at 0x[0-9a-f]+", "", str(inspect.signature(fn)))
    except (TypeError, ValueError):
        signature = "(*args, **kwargs)"
    doc = _own_doc(fn).replace('"""', "\'\'\'")
    stub = f'def {fn.__name__}{signature}:\n' + textwrap.indent(f'"""{doc}\n"""', "    ") + "\n"
    if cls is not None:
        stub = f"class {cls}:\n    ...\n\n" + textwrap.indent(stub, "    ")
    return f"{CODE_STUB_INSTRUCTION}\n\n```python\n# module: {module}\n{stub}```"


def code_stub_prompts(n: int | None = None, seed: int = 0) -> list[list[dict]]:
    """Function stubs from the standard library: signature + docstring, "Complete the body of this function"."""
    return [[{"role": "user", "content": code_stub(*entry)}] for entry in _seeded_cycle(code_stubs(), n, seed)]


FOLLOW_UPS = ("What are the main limitations of the evidence behind that answer?",
              "Can you explain that to a patient in plain language, in two or three sentences?",
              "Which study design would best confirm this finding, and why?",
              "What would change your answer, and what should a clinician watch for?",
              "Summarize the key numbers or effect sizes behind this conclusion.",
              "How does this compare with current clinical guidelines?",
              "What are the practical implications for treatment decisions?",
              "Which patients would this result not apply to?")


def chat_prompts(n: int | None = None, seed: int = 0) -> list[list[dict]]:
    """Multi-turn medical chats: a held-out PubMedQA question, its long answer as the assistant's turn, then a
    follow-up question (one of FOLLOW_UPS, chosen with the seed) that the model answers."""
    _, held = split_pubmedqa()
    rng = random.Random(seed + 1)
    return [[{"role": "user", "content": it["question"]}, {"role": "assistant", "content": it["answer"]},
             {"role": "user", "content": FOLLOW_UPS[rng.randrange(len(FOLLOW_UPS))]}]
            for it in _seeded_cycle(held, n, seed)]


REALISTIC_PROMPT_SETS = {"medical-rag": medical_rag_prompts, "code": code_stub_prompts, "chat": chat_prompts}
