"""Load a draft/target pair (local HF folders, or the embedded tiny pair) and a static vocabulary."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from evospec.engine.generate import SpeculativeDecoder
from evospec.model import load_qwen3
from evospec.tokenizer import load_tokenizer
from evospec.vocab.retrieval import CoocIndex
from evospec.vocab.static import StaticVocab

DEFAULT_STATIC_VOCAB = Path(__file__).parent / "vocab" / "data" / "qwen3-specbench-32k.json"
DEFAULT_COOC = Path(__file__).parent / "vocab" / "data" / "cooc-pubmedqa.safetensors"
QWEN3_STOP_IDS = (151645, 151643)  # <|im_end|>, <|endoftext|>


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]


def resolve_pair(draft_path: str | None, target_path: str | None) -> tuple[Path, Path]:
    """Explicit folders, else the embedded tiny pair (expanded from the committed weights on first use)."""
    if (draft_path is None) != (target_path is None):
        raise ValueError("give both --draft and --target model folders, or neither (the embedded tiny pair)")
    if draft_path is None:
        from evospec.tiny_pair import ensure_hf_folders
        return ensure_hf_folders()
    return Path(draft_path), Path(target_path)


@dataclass
class LoadedPair:
    decoder: SpeculativeDecoder
    tokenizer: object
    draft_path: Path
    target_path: Path
    static_vocab: StaticVocab | None


def load_pair(draft_path: str | None = None, target_path: str | None = None,
              static_vocab_path: str | Path | None = DEFAULT_STATIC_VOCAB, device: str = "auto",
              dtype: str = "auto", max_model_len: int | None = None,
              cooc_path: str | Path | None = DEFAULT_COOC) -> LoadedPair:
    draft_dir, target_dir = resolve_pair(draft_path, target_path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    target = load_qwen3(target_dir, dev, dt)
    draft = load_qwen3(draft_dir, dev, dt)
    static = StaticVocab.load(Path(static_vocab_path)) if static_vocab_path else None
    cooc = CoocIndex.load(cooc_path) if cooc_path and Path(cooc_path).exists() else None
    decoder = SpeculativeDecoder(target, draft, static_ids=torch.tensor(static.token_ids) if static else None,
                                 max_model_len=max_model_len, eos_ids=QWEN3_STOP_IDS, cooc=cooc)
    return LoadedPair(decoder, load_tokenizer(str(target_dir)), draft_dir, target_dir, static)
