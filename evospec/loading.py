"""Load a draft/target pair (local HF folders, or the embedded tiny pair), its stop ids and a static vocabulary."""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from evospec.cache import cache_dir
from evospec.config import AdaptConfig, ModelConfig
from evospec.engine.generate import SpeculativeDecoder
from evospec.model import Qwen3, load_qwen3
from evospec.model.qwen3 import calibrate_single_token_padding, read_config
from evospec.model.weight_formats import FormatChoices, apply_weight_format, auto_format, gguf_block_weights
from evospec.modelstore.catalog import TINY, get_pair
from evospec.tokenizer import load_tokenizer
from evospec.vocab.retrieval import CoocIndex
from evospec.vocab.static import StaticVocab

VOCAB_DATA = Path(__file__).parent / "vocab" / "data"
DEFAULT_STATIC_VOCAB = VOCAB_DATA / "qwen3-specbench-32k.json"
DEFAULT_COOC = VOCAB_DATA / "cooc-pubmedqa.safetensors"
STORE_PREFIX = "store:"  # ModelConfig.path "store:<pair>/<role>" = a pair fetched by `evospec models fetch <pair>`
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 (AVX512-BF16, AMX-BF16) and arm64 (/proc/cpuinfo)
log = logging.getLogger(__name__)
T = TypeVar("T")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@functools.cache
def cpu_info() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where it is not readable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    info: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        info[key.strip()] = value.strip()
    return info


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (x86 `flags`, arm64 `Features`)."""
    info = cpu_info()
    return frozenset((info.get("flags") or info.get("Features") or "").split())


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively. Without it (AVX2 only), torch's bf16 matmuls convert in software:
    a prefill measured 4.8x slower than float32 (docs/results.md, "Dtype chosen for the machine")."""
    flags = cpu_flags()
    if flags:
        return bool(flags & NATIVE_BF16_FLAGS)
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)  # no /proc/cpuinfo: ask torch (private API)
    return bool(probe and probe())


@functools.cache
def cpu_description() -> str:
    """The CPU model and what torch runs on it, for logs, Info and every benchmark result."""
    native = "native bf16" if cpu_has_native_bf16() else "no native bf16"
    return f"{cpu_info().get('model name') or 'unknown CPU'} ({torch.backends.cpu.get_cpu_capability()}, {native})"


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA and on CPUs that multiply bf16 natively, float32 on every other CPU (float32 is the
    reference numerics: the served numerics can differ between machines, greedy output with them)."""
    if dtype == "auto":
        if device.type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    chosen = DTYPES[dtype]
    if device.type == "cpu" and chosen == torch.bfloat16 and not cpu_has_native_bf16():
        log.warning("dtype bfloat16 on a CPU without native bf16 (%s): forwards run several times slower than in "
                    "float32; `dtype: auto` chooses float32 here", cpu_description())
    return chosen


def apply_torch_threads(threads: int | None) -> None:
    """Ray sets OMP_NUM_THREADS from a replica's num_cpus (1 when it is 0), which silently halves CPU speed on a
    2-core box; a configured thread count overrides it."""
    if threads:
        torch.set_num_threads(threads)


def in_passing_thread(work: Callable[[], T], name: str = "evospec-load") -> T:
    """`work()` run in a thread of its own that ends when it returns (its result returned, its exception raised here).

    Why: OpenMP (torch's CPU threads) keeps a team of worker threads for each thread that ran parallel work, for as
    long as that thread lives. When the teams hold more threads than the machine has CPUs, libgomp stops
    spin-waiting between parallel regions and every region pays a sleep and wake-up: a 1.5B decode step run by an
    engine thread took 60-100 ms instead of 41-45 ms (2-core AMD EPYC, torch 2.13) because another thread had
    loaded and warmed up the model. Loading, kernel choices and warm-up run here, so when the thread ends its team
    goes with it and the engine's thread is the only one left with one (docs/deploy.md, "One compute thread")."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = work()
        except BaseException as err:  # noqa: BLE001 (handed to the caller, re-raised there)
            box["error"] = err

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def apply_cpu_settings(cfg: ModelConfig) -> None:
    """The process's CPU share for this model: its torch threads and, when configured, the cores it may run on."""
    if cfg.cpu_affinity is not None:
        if not hasattr(os, "sched_setaffinity"):
            raise ValueError("model.cpu_affinity needs Linux (os.sched_setaffinity)")
        unknown = set(cfg.cpu_affinity) - os.sched_getaffinity(0)
        if unknown:
            raise ValueError(f"model.cpu_affinity names CPUs {sorted(unknown)} this process may not use "
                             f"(allowed: {sorted(os.sched_getaffinity(0))})")
        os.sched_setaffinity(0, cfg.cpu_affinity)
    apply_torch_threads(cfg.torch_threads)


def model_folder(cfg: ModelConfig, role: str) -> Path:
    """The HF folder of one model of the pair ("draft" or "target"): a local folder, a fetched pair
    ("store:qwen2.5-coder/target"), or the embedded tiny pair when path is None."""
    if cfg.path is None:
        from evospec.tiny_pair import ensure_hf_folders
        return dict(zip(("draft", "target"), ensure_hf_folders()))[role]
    if cfg.path.startswith(STORE_PREFIX):
        from evospec.modelstore import fetched_folder
        pair, _, stored_role = cfg.path.removeprefix(STORE_PREFIX).partition("/")
        return fetched_folder(pair, stored_role or role)
    return Path(cfg.path)


def load_model(cfg: ModelConfig, role: str) -> tuple[Qwen3, Path]:
    folder = model_folder(cfg, role)
    # The embedded tiny pair (8M parameters: no speed to win) stays in float32 under auto, the reference numerics its
    # token-for-token tests compare against, whatever the CPU.
    dtype = "float32" if cfg.path is None and cfg.dtype == "auto" else cfg.dtype
    model = load_qwen3_folder(folder, dtype, cfg.device, cfg.quantize, embedded=cfg.path is None,
                              verifies=role == "target")
    weights = model.embed_tokens.weight
    log.info("%s %s: %s on %s (dtype %s, weights %s%s)", role, folder.name, weights.dtype, weights.device, cfg.dtype,
             model.weight_format, f"; CPU {cpu_description()}" if weights.device.type == "cpu" else "")
    return model, folder


def load_qwen3_folder(folder: Path, dtype: str = "auto", device: str = "auto", quantize: str = "none",
                      embedded: bool = False, verifies: bool = True) -> Qwen3:
    """Load a model folder in `dtype`, put it in weight format `quantize` (model/weight_formats.py; `auto` measured
    here, or remembered from an earlier measurement on this machine) and calibrate single-token padding for the
    format it runs in. The format is known before the weights are read: under `gguf` the projections come from the
    source GGUF's blocks, so their dense copies are never read."""
    dev = resolve_device(device)
    load_dtype = resolve_dtype(dtype, dev)
    fmt, measured = quantize, {}
    if quantize == "auto":
        fmt, measured = auto_format(read_config(folder), load_dtype, folder, dev, embedded, verifies,
                                    format_choices())
    # int8 (fbgemm) runs float32 models only; gguf's kernels and native step compute in float32 (kernels/fused_step.py)
    if fmt == "int8" or (fmt == "gguf" and dtype == "auto"):
        load_dtype = torch.float32
    model = load_qwen3(folder, dev, load_dtype, skip=gguf_block_weights(folder) if fmt == "gguf" else ())
    model = apply_weight_format(model, fmt, folder, embedded=embedded, verifies=verifies,
                                dtype_auto=dtype == "auto")
    model.weight_format_seconds = measured
    calibrate_single_token_padding(model)
    return model


def format_choices() -> FormatChoices:
    """Where `auto` weight formats measured on this machine are remembered (model/weight_formats.py)."""
    return FormatChoices(cache_dir() / "measured" / "weight-formats.json",
                         {"cpu": cpu_description(), "flags": sorted(cpu_flags())})


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


def given_or_packaged(path: str | Path, folder: Path) -> Path:
    """`path` when it exists, else the file of that name in a folder that ships with the package (so an installed
    project finds its own YAMLs and vocabulary artifacts by name), else `path` unchanged (its open fails clearly)."""
    given = Path(path)
    packaged = folder / given.name
    return packaged if not given.exists() and packaged.exists() else given


def vocab_data_path(path: str | Path | None, default: Path) -> Path:
    """A given path or a file of the committed evospec/vocab/data/ by that name; None = `default`."""
    return default if path is None else given_or_packaged(path, VOCAB_DATA)


def load_static_ids(path: str | Path | None) -> tuple[torch.Tensor, str]:
    """Ranked static ids of the artifact (default: committed Spec-Bench 32k for the Qwen3 tokenizer) and its hash."""
    path = vocab_data_path(path, DEFAULT_STATIC_VOCAB)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return torch.tensor(StaticVocab.load(path).token_ids), sha


def load_cooc(path: str | Path | None) -> CoocIndex | None:
    path = vocab_data_path(path, DEFAULT_COOC)
    return CoocIndex.load(path) if path.exists() else None


@dataclass
class LoadedPair:
    decoder: SpeculativeDecoder
    tokenizer: object
    draft_path: Path
    target_path: Path
    stop_ids: tuple[int, ...]
    static_vocab: str  # the artifact's file name


def load_pair(draft: ModelConfig = ModelConfig(), target: ModelConfig = ModelConfig(),
              static_vocab_path: str | Path | None = None, max_model_len: int | None = None,
              cooc_path: str | Path | None = None, adapt: AdaptConfig = AdaptConfig()) -> LoadedPair:
    """Both models in this process (demo --in-process, benchmarks). Paths None = embedded defaults. adapt: online
    adaptation of the draft (its worker runs until `decoder.close()`)."""
    if (draft.path is None) != (target.path is None):
        raise ValueError("give both --draft and --target model folders, or neither (the embedded tiny pair)")
    target_model, target_dir = load_model(target, "target")
    draft_model, draft_dir = load_model(draft, "draft")
    static_ids, _ = load_static_ids(static_vocab_path)
    stop_ids = stop_token_ids(target_dir)
    decoder = SpeculativeDecoder(target_model, draft_model, static_ids=static_ids, max_model_len=max_model_len,
                                 eos_ids=stop_ids, cooc=load_cooc(cooc_path), adapt=adapt)
    return LoadedPair(decoder, load_tokenizer(str(target_dir)), draft_dir, target_dir, stop_ids,
                      vocab_data_path(static_vocab_path, DEFAULT_STATIC_VOCAB).name)


def named_pair_models(name: str = TINY, device: str = "auto", dtype: str = "auto",
                      draft_quantize: str = "none") -> tuple[ModelConfig, ModelConfig]:
    """(draft, target) configs of the embedded tiny pair or of a pair of the model store.
    draft_quantize int8: the draft runs float32 activations over int8 decoder weights (CPU)."""
    prefix = "" if name == TINY else f"{STORE_PREFIX}{get_pair(name).name}/"
    draft = ModelConfig(path=f"{prefix}draft" if prefix else None, device=device, quantize=draft_quantize,
                        dtype="float32" if draft_quantize == "int8" else dtype)
    return draft, ModelConfig(path=f"{prefix}target" if prefix else None, device=device, dtype=dtype)


def named_pair_folders(name: str = TINY) -> dict[str, Path]:
    """{"draft": folder, "target": folder} of a named pair, without loading it."""
    return {role: model_folder(cfg, role) for role, cfg in zip(("draft", "target"), named_pair_models(name))}


def load_named_pair(name: str = TINY, device: str = "auto", dtype: str = "auto",
                    draft_quantize: str = "none", adapt: AdaptConfig = AdaptConfig()) -> LoadedPair:
    """The embedded tiny pair, or a pair of the model store (fetched beforehand) with its own static vocabulary."""
    draft, target = named_pair_models(name, device, dtype, draft_quantize)
    return load_pair(draft, target, static_vocab_path=None if name == TINY else get_pair(name).static_vocab,
                     adapt=adapt)
