"""CUDA paths (bf16): skipped without a GPU. Same checks as on CPU: HF parity and greedy identity."""
import pytest
import torch

from evospec.config import SamplingParams, SpecParams, TreeParams
from evospec.engine.generate import SpeculativeDecoder
from evospec.testing import random_pair

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_greedy_identical_on_cuda_bf16():
    target, draft = random_pair(vocab=4096, seed=0, eos=-1, hidden=128)
    target, draft = target.to("cuda", torch.bfloat16), draft.to("cuda", torch.bfloat16)
    dec = SpeculativeDecoder(target, draft, static_ids=torch.arange(2048))
    sampling = SamplingParams(max_tokens=64, ignore_eos=True)
    ref = dec.generate([1, 2, 3], sampling, SpecParams(method="ar"))
    list(ref)
    for method in ("sd", "frspec", "evospec"):
        for tree in (TreeParams(shape="chain", num_draft_tokens=4), TreeParams(shape="tree", budget=16)):
            out = dec.generate([1, 2, 3], sampling, SpecParams(method=method, tree=tree,
                                                               vocab={"static_size": 2048, "dynamic_size": 64}))
            list(out)
            assert out.output_ids == ref.output_ids


def test_hf_folder_loads_on_cuda(tmp_path):
    transformers = pytest.importorskip("transformers")
    from evospec.model import load_qwen3
    cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   tie_word_embeddings=True)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(tmp_path)
    model = load_qwen3(tmp_path, device="cuda")
    assert model.embed_tokens.weight.is_cuda and model.embed_tokens.weight.dtype == torch.bfloat16
