"""GGUF file -> Hugging Face folder, with transformers' GGUF loader (the `gguf` package reads the file).

transformers keeps GGUF weights packed by default (slow, and it refuses to save them); `GgufConfig(dequantize=True)`
builds a plain dense model that saves normally. Weights are stored in bfloat16, the dtype Qwen publishes; the
tokenizer and its chat template come from the GGUF metadata; generation_config.json gets the upstream stop ids.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from evospec.modelstore.catalog import GgufModel, PairSpec

SAVE_DTYPE = torch.bfloat16


def generation_config(pair: PairSpec) -> dict:
    return {"bos_token_id": pair.pad_token_id, "eos_token_id": list(pair.eos_token_ids),
            "pad_token_id": pair.pad_token_id, "do_sample": False}


def gguf_to_hf(gguf: Path, out: Path, pair: PairSpec, model: GgufModel, progress: bool = True,
               dtype: torch.dtype = SAVE_DTYPE) -> None:
    """Write the HF folder of `gguf` into `out` (the caller renames it into place when complete)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    steps = tqdm(total=3, desc=f"convert {model.role}", unit="step", disable=not progress)
    steps.set_postfix_str("dequantize weights")
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype,
                                              quantization_config=GgufConfig(dequantize=True))
    steps.update()
    steps.set_postfix_str("save safetensors")
    hf.save_pretrained(out)
    del hf
    steps.update()
    steps.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps(generation_config(pair), indent=1))
    steps.update()
    steps.close()
