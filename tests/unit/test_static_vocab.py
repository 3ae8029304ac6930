"""`evospec vocab build`: frequency ranking, specials, artifact round trip, SGLang token-map interop and validation."""
import json

import pytest
import torch

from evospec.orchestration.cli import main as cli
from evospec.tokenizer import chat_special_token_ids, load_tokenizer
from evospec.vocab.static import (
    StaticVocab,
    build_static_vocab,
    export_sglang_token_map,
    import_sglang_token_map,
    rank_tokens,
)


def test_rank_tokens_specials_first_then_counts_then_id_order():
    from collections import Counter
    ids, counts = rank_tokens(Counter({7: 5, 3: 9, 9: 5}), size=6, always=[11], vocab_size=20)
    assert ids == [11, 3, 7, 9, 0, 1] and counts == [0, 9, 5, 5, 0, 0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    (d / "a.jsonl").write_text("\n".join(json.dumps({"turns": ["the cat sat on the mat", "the end"]})
                                         for _ in range(3)))
    (d / "b.txt").write_text("the dog\nthe dog barked\n")
    return d


def test_build_save_load_and_sglang_round_trip(corpus, tmp_path):
    tok = load_tokenizer()
    vocab = build_static_vocab(tok, [corpus / "a.jsonl", corpus / "b.txt"], ("turns",), size=64)
    (the,) = tok("the", add_special_tokens=False)["input_ids"]  # 8 occurrences: the most frequent token
    specials = chat_special_token_ids(tok)
    assert vocab.token_ids[: len(specials)] == specials  # EOS and chat specials always in, first
    assert vocab.token_ids[len(specials)] == the and vocab.counts[len(specials)] == 8
    assert len(vocab.token_ids) == 64 and len(set(vocab.token_ids)) == 64
    assert vocab.meta["tokenizer_sha"] and vocab.meta["tokens_counted"] > 0
    vocab.save(tmp_path / "v.json")
    loaded = StaticVocab.load(tmp_path / "v.json")
    assert loaded.token_ids == vocab.token_ids and loaded.meta["corpus"] == ["a.jsonl", "b.txt"]
    export_sglang_token_map(loaded, tmp_path / "map.pt", size=32)
    assert torch.load(tmp_path / "map.pt", weights_only=True) == vocab.token_ids[:32]  # SGLang's format: list[int]
    back = import_sglang_token_map(tmp_path / "map.pt", vocab_size=len(tok))
    assert back.token_ids == vocab.token_ids[:32]


@pytest.mark.parametrize("payload,match", [([1, 2, 2], "duplicate"), ([1, 10**7], "out of range"), ([], "empty"),
                                           (["a"], "list of ints")])
def test_sglang_import_validates(tmp_path, payload, match):
    torch.save(payload, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=match):
        import_sglang_token_map(tmp_path / "bad.pt", vocab_size=151_669)


def test_sglang_import_refuses_pickled_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))
    torch.save([Evil()], tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="refused to unpickle"):
        import_sglang_token_map(tmp_path / "evil.pt", vocab_size=100)


def test_cli_build_and_export(corpus, tmp_path, capsys):
    out = tmp_path / "cli.json"
    assert cli(["vocab", "build", "--corpus", str(corpus / "a.jsonl"), "--field", "turns", "--size", "40",
                "--out", str(out), "--sglang-sizes", "16"]) == 0
    assert len(StaticVocab.load(out).token_ids) == 40
    assert len(torch.load(out.with_suffix(".sglang-16.pt"), weights_only=True)) == 16


def test_committed_default_artifact_is_general_text():
    from evospec.loading import DEFAULT_STATIC_VOCAB
    v = StaticVocab.load(DEFAULT_STATIC_VOCAB)
    assert len(v.token_ids) == 32768 and v.meta["corpus"] == ["question.jsonl"]  # Spec-Bench, not PubMedQA
