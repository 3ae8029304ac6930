"""The embedded tiny Qwen3 pair: committed compact weights -> standard Hugging Face folders on first use."""
from __future__ import annotations

import hashlib
from pathlib import Path

from evospec.cache import cache_dir

WEIGHTS_DIR = Path(__file__).parent / "weights"

# Shapes of the pair (Qwen3 architecture; the tokenizer and the 151,936-row vocabulary are the real Qwen3 ones).
TARGET_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64)
DRAFT_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=64)


def hf_config(shape: dict) -> dict:
    """A Qwen3 config.json for the given shape with the full Qwen3 vocabulary and tied embeddings."""
    from evospec.tokenizer import QWEN3_VOCAB_ROWS
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": QWEN3_VOCAB_ROWS,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
            "tie_word_embeddings": True, "attention_bias": False, "hidden_act": "silu",
            "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "float32", **shape}


# Qwen3's own generation_config.json: generation stops on <|im_end|> or <|endoftext|>.
GENERATION_CONFIG = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}
FOLDER_FORMAT = 2  # bump when the expanded folder's contents change (2: generation_config.json)


def ensure_hf_folders() -> tuple[Path, Path]:
    """Expand the committed compact weights into HF folders (cached by content hash). Returns (draft_dir, target_dir)."""
    from evospec.tiny_pair.expand import expand_compact
    out = []
    for name, shape in (("draft", DRAFT_SHAPE), ("target", TARGET_SHAPE)):
        src = WEIGHTS_DIR / f"{name}.safetensors"
        if not src.exists():
            raise FileNotFoundError(f"{src} missing: run `python -m evospec.tiny_pair.train` to produce the tiny pair")
        digest = hashlib.sha1(src.read_bytes()).hexdigest()[:12]
        folder = cache_dir() / f"tiny-{name}-{digest}-f{FOLDER_FORMAT}"
        if not (folder / "model.safetensors").exists():
            expand_compact(src, folder, hf_config(shape), GENERATION_CONFIG)
        out.append(folder)
    return out[0], out[1]
