"""Load a draft/target pair (local HF folders, or the embedded tiny pair), its stop ids and a static vocabulary."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from evospec.config import ModelConfig
from evospec.engine.generate import SpeculativeDecoder
from evospec.model import Qwen3, load_qwen3
from evospec.tokenizer import load_tokenizer
from evospec.vocab.retrieval import CoocIndex
from evospec.vocab.static import StaticVocab

DEFAULT_STATIC_VOCAB = Path(__file__).parent / "vocab" / "data" / "qwen3-specbench-32k.json"
DEFAULT_COOC = Path(__file__).parent / "vocab" / "data" / "cooc-pubmedqa.safetensors"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


def apply_torch_threads(threads: int | None) -> None:
    """Ray sets OMP_NUM_THREADS from a replica's num_cpus (1 when it is 0), which silently halves CPU speed on a
    2-core box; a configured thread count overrides it."""
    if threads:
        torch.set_num_threads(threads)


def model_folder(cfg: ModelConfig, role: str) -> Path:
    """The HF folder of one model of the pair ("draft" or "target"); path None = the embedded tiny pair."""
    if cfg.path is not None:
        return Path(cfg.path)
    from evospec.tiny_pair import ensure_hf_folders
    return dict(zip(("draft", "target"), ensure_hf_folders()))[role]


def load_model(cfg: ModelConfig, role: str) -> tuple[Qwen3, Path]:
    folder = model_folder(cfg, role)
    device = resolve_device(cfg.device)
    return load_qwen3(folder, device, resolve_dtype(cfg.dtype, device)), folder


def stop_token_ids(folder: Path) -> tuple[int, ...]:
    """The ids generation stops on, from the model's own files: generation_config.json's eos_token_id (an id or a
    list, e.g. Qwen3's [<|im_end|>, <|endoftext|>]), else config.json's."""
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    raise ValueError(f"{folder} names no eos_token_id in generation_config.json or config.json")


def load_static_ids(path: str | Path | None) -> tuple[torch.Tensor, str]:
    """Ranked static ids of the artifact (default: committed Spec-Bench 32k) and its content hash."""
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
    stop_ids: tuple[int, ...]


def load_pair(draft: ModelConfig = ModelConfig(), target: ModelConfig = ModelConfig(),
              static_vocab_path: str | Path | None = None, max_model_len: int | None = None,
              cooc_path: str | Path | None = None) -> LoadedPair:
    """Both models in this process (demo --in-process, benchmarks). Paths None = embedded defaults."""
    if (draft.path is None) != (target.path is None):
        raise ValueError("give both --draft and --target model folders, or neither (the embedded tiny pair)")
    target_model, target_dir = load_model(target, "target")
    draft_model, draft_dir = load_model(draft, "draft")
    static_ids, _ = load_static_ids(static_vocab_path)
    stop_ids = stop_token_ids(target_dir)
    decoder = SpeculativeDecoder(target_model, draft_model, static_ids=static_ids, max_model_len=max_model_len,
                                 eos_ids=stop_ids, cooc=load_cooc(cooc_path))
    return LoadedPair(decoder, load_tokenizer(str(target_dir)), draft_dir, target_dir, stop_ids)
