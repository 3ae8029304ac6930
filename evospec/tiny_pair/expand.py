"""Compact (seen rows only, fp16) weights -> a standard HF Qwen3 folder with all 151,936 embedding rows (fp32)."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from evospec.tokenizer import qwen3_tokenizer_dir


def expand_compact(src: Path, folder: Path, config: dict, generation_config: dict) -> None:
    compact = load_file(str(src))
    seen_ids = compact.pop("seen_token_ids").long()
    embed = compact.pop("model.embed_tokens.weight").float()
    unseen_row = compact.pop("unseen_row", torch.zeros(embed.shape[1])).float()
    full = unseen_row.expand(config["vocab_size"], -1).clone()  # never-seen rows: the shared learned row
    full[seen_ids] = embed
    state = {"model.embed_tokens.weight": full, **{k: v.float() for k, v in compact.items()}}
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent))  # write then rename: concurrent first uses never see half a folder
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    for f in qwen3_tokenizer_dir().iterdir():
        if f.is_file():
            shutil.copy(f, tmp / f.name)
    try:
        tmp.rename(folder)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
