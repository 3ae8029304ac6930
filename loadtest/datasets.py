"""Load-test prompt datasets: medical (PubMedQA questions), Spec-Bench, or your own JSONL ({"prompt": ...} or
{"messages": [...]}, optional "max_tokens"). Output lengths: fixed, or sampled uniformly in a range."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LoadRequest:
    messages: list[dict]
    max_tokens: int
    temperature: float = 0.0  # greedy by default; sampled load tools (guidellm) send none, i.e. OpenAI's 1.0
    ignore_eos: bool = False  # always generate max_tokens (vLLM's --ignore-eos; guidellm sends it)


def load_prompts(dataset: str, num_prompts: int, seed: int, path: str | None = None) -> list[list[dict]]:
    if dataset == "medical":
        from evospec.datasets import pubmedqa_items
        items = [[{"role": "user", "content": it["question"]}] for it in pubmedqa_items()]
    elif dataset == "spec-bench":
        from evospec.datasets import spec_bench_prompts
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


def build_requests(prompts: list[list[dict]], output_len: int, output_len_range: tuple[int, int] | None,
                   seed: int, temperature: float = 0.0, ignore_eos: bool = False) -> list[LoadRequest]:
    rng = random.Random(seed + 1)
    return [LoadRequest(p, rng.randint(*output_len_range) if output_len_range else output_len, temperature,
                        ignore_eos) for p in prompts]


def write_jsonl(requests: list[LoadRequest], path: Path) -> None:
    """The requests as a JSONL other load tools read (guidellm's json_file: `prompt` + `output_tokens_count`;
    multi-turn chats as `messages`), so both drive the same load."""
    with open(path, "w") as f:
        for r in requests:
            row = {"prompt": r.messages[0]["content"]} if len(r.messages) == 1 else {"messages": r.messages}
            f.write(json.dumps({**row, "output_tokens_count": r.max_tokens}) + "\n")
