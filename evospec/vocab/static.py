"""FR-Spec static vocabulary S: the K most frequent tokens of a (general) corpus, as a versioned artifact.

Artifact (JSON, `format: evospec.static_vocab/v1`): ranked `token_ids` (most frequent first, so any K' <= K is a
prefix), their `counts`, and metadata (tokenizer hash, corpus files, tokens counted). EOS and the chat special tokens
are always included, ranked first. When the corpus has fewer distinct tokens than K, the remaining slots are filled
in token-id order: Qwen3's byte-level BPE numbers tokens in merge order, which follows frequency in the tokenizer's
own training corpus, so low ids are the best prior for tokens our corpus never showed.

SGLang interop: `--speculative-token-map` is a `.pt` file holding a list of ints (loaded by SGLang with torch.load).
We read it with `weights_only=True` (no pickle code execution) and validate it.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

FORMAT = "evospec.static_vocab/v1"
@dataclass
class StaticVocab:
    token_ids: list[int]  # ranked, most frequent first
    counts: list[int]
    meta: dict = field(default_factory=dict)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"format": FORMAT, **self.meta, "token_ids": self.token_ids,
                                    "counts": self.counts}, separators=(",", ":")))

    @classmethod
    def load(cls, path: Path) -> "StaticVocab":
        data = json.loads(Path(path).read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: not a {FORMAT} artifact (format={data.get('format')!r})")
        ids, counts = data.pop("token_ids"), data.pop("counts")
        validate_token_ids(ids, data.get("vocab_size", max(ids) + 1), source=str(path))
        return cls(ids, counts, data)


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the tokenizer's vocabulary (id <-> token), so an artifact is never used with another tokenizer."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def compare_tokenizers(a, b) -> dict:
    """How token ids of tokenizer `a` relate to `b`'s (e.g. the real pair's vs the Qwen3 tokenizer the committed
    artifacts were built with): a static artifact carries over only for the ids both map to the same string."""
    va, vb = a.get_vocab(), b.get_vocab()
    shared = va.keys() & vb.keys()
    same = [t for t in shared if va[t] == vb[t]]
    moved = sorted(t for t in shared if va[t] != vb[t])
    return {"size_a": len(va), "size_b": len(vb), "same_id": len(same), "different_id": moved,
            "only_a": sorted(va.keys() - vb.keys(), key=va.get), "only_b": sorted(vb.keys() - va.keys(), key=vb.get)}


def iter_corpus_texts(paths: Iterable[Path], fields: tuple[str, ...]) -> Iterator[tuple[str, int]]:
    """Yields (text, bytes consumed). .jsonl rows: the given fields (a string or a list of strings); other files: lines."""
    for path in map(Path, paths):
        with path.open(encoding="utf-8") as f:
            for line in f:
                if path.suffix == ".jsonl" and line.strip():
                    row = json.loads(line)
                    for name in fields:
                        value = row.get(name)
                        for text in (value if isinstance(value, list) else [value]):
                            if isinstance(text, str):
                                yield text, 0
                    yield "", len(line.encode())
                else:
                    yield line, len(line.encode())


def count_tokens(tokenizer, paths: list[Path], fields: tuple[str, ...], batch: int = 256) -> tuple[Counter, int]:
    """Streaming token-frequency count with a progress bar over input bytes."""
    counts: Counter = Counter()
    total_bytes = sum(Path(p).stat().st_size for p in paths)
    pending: list[str] = []
    n_tokens = 0
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="counting tokens") as bar:
        for text, consumed in iter_corpus_texts(paths, fields):
            if text:
                pending.append(text)
            bar.update(consumed)
            if len(pending) >= batch:
                n_tokens += _count_batch(tokenizer, pending, counts)
                pending = []
        if pending:
            n_tokens += _count_batch(tokenizer, pending, counts)
    return counts, n_tokens


def _count_batch(tokenizer, texts: list[str], counts: Counter) -> int:
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    for ids in encoded:
        counts.update(ids)
    return sum(map(len, encoded))


def rank_tokens(counts: Counter, size: int, always: list[int], vocab_size: int) -> tuple[list[int], list[int]]:
    """Specials first, then by count (desc; ties by id), then never-seen ids in id (BPE merge) order."""
    ranked = list(dict.fromkeys(always))
    taken = set(ranked)
    for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(ranked) >= size:
            break
        if tok not in taken:
            ranked.append(tok)
            taken.add(tok)
    next_id = 0
    while len(ranked) < size and next_id < vocab_size:
        if next_id not in taken:
            ranked.append(next_id)
            taken.add(next_id)
        next_id += 1
    return ranked[:size], [counts.get(t, 0) for t in ranked[:size]]


def build_static_vocab(tokenizer, paths: list[Path], fields: tuple[str, ...], size: int) -> StaticVocab:
    from evospec.tokenizer import chat_special_token_ids
    counts, n_tokens = count_tokens(tokenizer, paths, fields)
    vocab_size = len(tokenizer)
    ids, ranked_counts = rank_tokens(counts, size, chat_special_token_ids(tokenizer), vocab_size)
    meta = {"tokenizer_sha": tokenizer_hash(tokenizer), "vocab_size": vocab_size,
            "corpus": [str(Path(p).name) for p in paths], "fields": list(fields), "tokens_counted": n_tokens,
            "distinct_tokens_seen": len(counts), "size": size}
    return StaticVocab(ids, ranked_counts, meta)


def validate_token_ids(ids, vocab_size: int, source: str) -> None:
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{source}: expected a list of ints")
    if not ids:
        raise ValueError(f"{source}: empty token list")
    dupes = len(ids) - len(set(ids))
    if dupes:
        raise ValueError(f"{source}: {dupes} duplicate token ids")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"{source}: ids out of range [0, {vocab_size}): {bad[:5]}")


def export_sglang_token_map(vocab: StaticVocab, path: Path, size: int | None = None) -> None:
    """Write SGLang's --speculative-token-map: a .pt list of ints."""
    torch.save(vocab.token_ids[: size or len(vocab.token_ids)], str(path))


def import_sglang_token_map(path: Path, vocab_size: int) -> StaticVocab:
    """Read an SGLang token map safely (weights_only=True) and validate it. Its order is kept as the ranking."""
    import pickle
    try:
        data = torch.load(str(path), weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only refuses arbitrary objects (and the code they would run)
        raise ValueError(f"{path}: not a token map (a list of ints or an int tensor); refused to unpickle it: "
                         f"{str(e).splitlines()[0]}") from None
    if isinstance(data, torch.Tensor):
        data = data.tolist()
    validate_token_ids(data, vocab_size, source=str(path))
    return StaticVocab(list(data), [0] * len(data), {"imported_from": "sglang", "source": Path(path).name,
                                                     "vocab_size": vocab_size, "size": len(data)})
