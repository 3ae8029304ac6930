"""Load-test requests: prompts (evospec.datasets.load_prompts: medical, Spec-Bench or your own JSONL) with output
lengths fixed or sampled uniformly in a range, and their export as JSONL for other load tools."""
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
