"""Offline co-occurrence index for EvoSpec's statistical retrieval: "token a seen -> long-tail token b likely soon".

For every pair (a, b) with b within `window` tokens after a and b outside the smallest static vocabulary, weight =
count(a then b) / count(a) (how often a is followed by b soon). Each key keeps its `per_key` best neighbours.
Stored as safetensors: keys [n] (sorted), neighbours [n, m] (-1 pad), weights [n, m].
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm


def build_cooc(docs: list[list[int]], long_tail: np.ndarray, window: int = 16, per_key: int = 16,
               min_count: int = 2) -> dict[str, torch.Tensor]:
    vocab = long_tail.shape[0]
    pair_counts: dict[int, int] = {}
    key_counts = np.zeros(vocab, dtype=np.int64)
    for doc in tqdm(docs, desc="co-occurrence"):
        ids = np.asarray(doc, dtype=np.int64)
        np.add.at(key_counts, ids, 1)
        for d in range(1, min(window, len(ids) - 1) + 1):
            a, b = ids[:-d], ids[d:]
            keep = long_tail[b] & (a != b)
            codes, counts = np.unique(a[keep] * vocab + b[keep], return_counts=True)
            for c, n in zip(codes.tolist(), counts.tolist()):
                pair_counts[c] = pair_counts.get(c, 0) + n
    by_key: dict[int, list[tuple[float, int]]] = {}
    for code, n in pair_counts.items():
        if n >= min_count:
            a, b = divmod(code, vocab)
            by_key.setdefault(a, []).append((min(1.0, n / key_counts[a]), b))
    keys = sorted(by_key)
    neighbours = torch.full((len(keys), per_key), -1, dtype=torch.int32)
    weights = torch.zeros(len(keys), per_key, dtype=torch.float16)
    for row, a in enumerate(keys):
        best = sorted(by_key[a], reverse=True)[:per_key]
        neighbours[row, : len(best)] = torch.tensor([b for _, b in best], dtype=torch.int32)
        weights[row, : len(best)] = torch.tensor([w for w, _ in best], dtype=torch.float16)
    return {"keys": torch.tensor(keys, dtype=torch.int32), "neighbours": neighbours, "weights": weights}


def build_pubmedqa_cooc(out: Path, static_artifact: Path, small_static: int = 8192) -> None:
    """The default index: PubMedQA training split (held-out benchmark items excluded), long tail = ∉ S_8k."""
    from evospec.datasets import split_pubmedqa
    from evospec.tokenizer import QWEN3_VOCAB_ROWS, load_tokenizer
    from evospec.vocab.static import StaticVocab
    tok = load_tokenizer()
    train, _ = split_pubmedqa()
    texts = [" ".join(it["contexts"]) + " " + it["question"] + " " + it["answer"] for it in train]
    docs = [tok(t, add_special_tokens=False)["input_ids"] for t in tqdm(texts, desc="tokenize")]
    long_tail = np.ones(QWEN3_VOCAB_ROWS, dtype=bool)
    long_tail[StaticVocab.load(static_artifact).token_ids[:small_static]] = False
    tensors = build_cooc(docs, long_tail)
    save_file(tensors, str(out), metadata={"corpus": "PubMedQA pqal train split", "window": "16",
                                           "long_tail": f"not in the first {small_static} static ids"})
    print(f"wrote {out}: {tensors['keys'].shape[0]} keys")
