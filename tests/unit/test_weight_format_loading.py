"""Loading in a weight format: `auto` is measured once per machine and remembered (a different machine, thread count
or model measures again); under `gguf` the projections the source GGUF holds are never read dense, and the model
computes exactly what loading them dense and replacing them gives."""
import pytest
import torch

from evospec import loading
from evospec.kernels import kquant
from evospec.kernels.kquant import q8_0_from_dense
from evospec.kernels.tree import chain_then_tree_mask
from evospec.model import load_qwen3, weight_formats
from evospec.model.qwen3 import plain_projections, read_config
from evospec.model.weight_formats import FormatChoices, auto_format
from evospec.tiny_pair import ensure_hf_folders


@pytest.fixture
def counted_choice(monkeypatch):
    calls = []

    def choose(cfg, dtype, four_bit_source, fused=False, six_bit_down=0.0):
        calls.append(dtype)
        return "int8-per-token", {"int8-per-token": 1.0, "none": 2.0}
    monkeypatch.setattr(weight_formats, "choose_format", choose)
    monkeypatch.delenv(FormatChoices.REMEASURE_ENV, raising=False)
    return calls


def test_auto_is_measured_once_per_machine(tmp_path, counted_choice, monkeypatch):
    cfg = read_config(ensure_hf_folders()[1])
    cpu = torch.device("cpu")
    here = FormatChoices(tmp_path / "formats.json", {"cpu": "Zen 3", "flags": ["avx2"]})
    assert auto_format(cfg, torch.float32, None, cpu, choices=here) == ("int8-per-token",
                                                                         {"int8-per-token": 1.0, "none": 2.0})
    assert auto_format(cfg, torch.float32, None, cpu, choices=here)[0] == "int8-per-token"
    assert len(counted_choice) == 1  # the second start-up remembered it
    elsewhere = FormatChoices(tmp_path / "formats.json", {"cpu": "Zen 4", "flags": ["avx2", "avx512f"]})
    auto_format(cfg, torch.float32, None, cpu, choices=elsewhere)
    auto_format(cfg, torch.bfloat16, None, cpu, choices=here)  # another question on this machine
    assert len(counted_choice) == 3
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        auto_format(cfg, torch.float32, None, cpu, choices=here)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv(FormatChoices.REMEASURE_ENV, "1")
    auto_format(cfg, torch.float32, None, cpu, choices=here)
    assert len(counted_choice) == 5
    assert auto_format(cfg, torch.float32, None, torch.device("meta"), choices=here) == ("none", {})  # no CPU


def test_an_unreadable_or_unwritable_memory_only_costs_a_measurement(tmp_path, counted_choice):
    cfg = read_config(ensure_hf_folders()[1])
    (tmp_path / "formats.json").write_text("{not json")
    blocked = FormatChoices(tmp_path / "formats.json" / "below-a-file", {"cpu": "x"})  # cannot be created
    assert auto_format(cfg, torch.float32, None, torch.device("cpu"), choices=blocked)[0] == "int8-per-token"
    garbled = FormatChoices(tmp_path / "formats.json", {"cpu": "x"})
    assert auto_format(cfg, torch.float32, None, torch.device("cpu"), choices=garbled)[0] == "int8-per-token"
    assert auto_format(cfg, torch.float32, None, torch.device("cpu"), choices=garbled)[0] == "int8-per-token"
    assert len(counted_choice) == 2  # the garbled file was replaced by a good one


def test_skipped_weights_are_not_read_and_stay_on_meta():
    folder = ensure_hf_folders()[1]
    skip = {"layers.0.mlp.down_proj.weight", "layers.1.self_attn.q_proj.weight"}
    model = load_qwen3(folder, skip=skip)
    params = dict(model.named_parameters())
    assert all(params[name].is_meta for name in skip)
    assert not any(p.is_meta for name, p in params.items() if name not in skip)


def test_a_tensor_the_model_has_no_place_for_is_refused(tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    folder = ensure_hf_folders()[1]
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    tensors = load_file(str(next(folder.glob("*.safetensors"))))
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected.*layers.0.mlp.extra.weight"):
        load_qwen3(tmp_path)


def test_gguf_loading_reads_no_projection_it_takes_from_the_gguf(monkeypatch):
    """The loader learns which projections the GGUF holds, never reads their dense weights, and the model it
    builds gives the logits of the dense model put in `gguf` with the same blocks."""
    folder = ensure_hf_folders()[1]
    dense = load_qwen3(folder)
    blocks = {name.removesuffix(".weight"): q8_0_from_dense(p.detach())
              for name, p in dense.named_parameters()
              if any(name == f"{proj}.weight" for proj in plain_projections(dense))
              and kquant.block_supported(*p.shape)}
    assert blocks
    monkeypatch.setattr(weight_formats, "source_gguf", lambda _: folder / "source.gguf")
    monkeypatch.setattr(weight_formats, "gguf_types", lambda _: {name: "Q8_0" for name in blocks})
    monkeypatch.setattr(weight_formats, "gguf_blocks", lambda _: blocks)
    read = []
    real_load = loading.load_qwen3
    monkeypatch.setattr(loading, "load_qwen3", lambda *a, **k: read.append(set(k.get("skip", ()))) or real_load(*a, **k))
    model = loading.load_qwen3_folder(folder, dtype="float32", device="cpu", quantize="gguf")
    assert read == [{f"{name}.weight" for name in blocks}]
    reference = weight_formats.apply_weight_format(load_qwen3(folder), "gguf", folder)
    ids = torch.tensor([5, 9, 33, 70, 12])
    mask = chain_then_tree_mask(0, len(ids), None)
    got = model.full_logits(model(ids, torch.arange(len(ids)), model.new_cache(8), mask))
    expected = reference.full_logits(reference(ids, torch.arange(len(ids)), reference.new_cache(8), mask))
    assert torch.equal(got, expected)
