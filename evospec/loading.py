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




def load_model(path: str | None, role: str, device: str = "auto", dtype: str = "auto"):
    """One model of the pair ("draft" or "target"): a local HF folder, or the embedded tiny one when path is None."""
    if path is None:
        from evospec.tiny_pair import ensure_hf_folders
        folder = dict(zip(("draft", "target"), ensure_hf_folders()))[role]
    else:
        folder = Path(path)
    dev = resolve_device(device)
    return load_qwen3(folder, dev, resolve_dtype(dtype, dev)), folder


def load_static_ids(path: str | Path | None) -> tuple[torch.Tensor, str]:
    """Ranked static ids of the artifact (default: committed Spec-Bench 32k) and its content hash."""
    import hashlib
    path = Path(path) if path else DEFAULT_STATIC_VOCAB
    sha = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return torch.tensor(StaticVocab.load(path).token_ids), sha


def load_cooc(path: str | Path | None) -> CoocIndex | None:
    path = Path(path) if path else DEFAULT_COOC
    return CoocIndex.load(path) if path.exists() else None


@dataclass
class LoadedPair:
    decoder: SpeculativeDecoder
    tokenizer: object
    draft_path: Path
    target_path: Path


def load_pair(draft_path: str | None = None, target_path: str | None = None,
              static_vocab_path: str | Path | None = None, device: str = "auto", dtype: str = "auto",
              max_model_len: int | None = None, cooc_path: str | Path | None = None) -> LoadedPair:
    """Both models in this process (demo --in-process, benchmarks). Paths None = embedded defaults."""
    if (draft_path is None) != (target_path is None):
        raise ValueError("give both --draft and --target model folders, or neither (the embedded tiny pair)")
    target, target_dir = load_model(target_path, "target", device, dtype)
    draft, draft_dir = load_model(draft_path, "draft", device, dtype)
    static_ids, _ = load_static_ids(static_vocab_path)
    decoder = SpeculativeDecoder(target, draft, static_ids=static_ids, max_model_len=max_model_len,
                                 eos_ids=QWEN3_STOP_IDS, cooc=load_cooc(cooc_path))
    return LoadedPair(decoder, load_tokenizer(str(target_dir)), draft_dir, target_dir)
