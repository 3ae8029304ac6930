"""Linear maps on GGUF k-quant blocks (Q4_K, Q6_K) times int8 activation blocks, through a native kernel
(kernels/kquant.c): the weights llama.cpp runs, multiplied the way llama.cpp multiplies them.

Why: torch 2.13's CPU kernels for quantized weights re-quantize a GGUF's Q4_K into their own int4 groups, hold
its Q6_K parts (half the v and down projections, the LM head) in int8, and on some CPUs dequantize to float in the
inner loop below the memory's rate (~15-17 GB/s of weights on a 2-core Zen 4 that reads 33 GB/s). Here the products
are integer (`maddubs`: 32 unsigned weight bytes times 32 signed activation bytes per instruction, 64 with AVX512),
one float multiply per 256 inputs, and the weights keep the GGUF's own bits: Q4_K (4-bit values, 6-bit scales and
mins per 32, a float per 256) and Q6_K, so the target computes with the very weights a llama.cpp user runs. On a
2-core Zen 5 one 1.5B decode step with the head took 35.0 ms against torch int4's 40.9 (docs/results.md).

The C source is compiled on first use for this CPU (`gcc -O3 -march=native -fopenmp`, ~1 s) into
`<cache>/kernels/`, keyed by the source and the CPU's flags; it needs AVX2 and a C compiler, and says in one line
why where either is missing (KQuantUnavailable). The kernel splits output columns over torch's thread count and
computes every output row on its own (kquant.c, "Row invariance"), so a k-row verify forward rounds as 1-row decode
forwards do: greedy speculation stays the target's own.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

QK = 256  # inputs per super-block (Q4_K, Q6_K)
QK0 = 32  # inputs per block (Q5_0, Q8_0: what a GGUF holds where a map's input width is not a multiple of 256)
Q4K_BLOCK_BYTES, Q6K_BLOCK_BYTES = 144, 210  # ggml's block_q4_K and block_q6_K
Q5_0_BLOCK_BYTES, Q8_0_BLOCK_BYTES = 22, 34  # ggml's block_q5_0 and block_q8_0
SUPER_BLOCK_KINDS, BLOCK_KINDS = ("q4k", "q6k"), ("q5_0", "q8_0")  # activations in Q8_K / in Q8_0 blocks
SOURCE = Path(__file__).with_name("kquant.c")


class KQuantUnavailable(RuntimeError):
    """The native k-quant kernel cannot run here (no AVX2, no C compiler, a failed build): one line saying which."""


def cache_dir() -> Path:
    """Where built kernels are kept: $EVOSPEC_CACHE/kernels or ~/.cache/evospec/kernels."""
    return Path(os.environ.get("EVOSPEC_CACHE", Path.home() / ".cache" / "evospec")) / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()


_LIBRARY: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """The kernel library, built for this CPU on first use (cached across processes)."""
    global _LIBRARY
    if _LIBRARY is not None:
        return _LIBRARY
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        raise KQuantUnavailable(f"the k-quant kernel needs AVX2; this CPU's torch ISA is "
                                f"{torch.backends.cpu.get_cpu_capability()}")
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        raise KQuantUnavailable("the k-quant kernel is built on first use and needs a C compiler (gcc); none found")
    # EVOSPEC_KQUANT_AVX2=1 builds the AVX2 path on an AVX512 machine (how its tests run on either kind of CPU)
    extra = ["-DKQ_FORCE_AVX2"] if os.environ.get("EVOSPEC_KQUANT_AVX2") == "1" else []
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + _cpu_flags().encode() + " ".join(extra).encode()).hexdigest()[:16]
    built = cache_dir() / f"kquant-{key}.so"
    if not built.exists():
        built.parent.mkdir(parents=True, exist_ok=True)
        partial = built.with_suffix(f".partial-{os.getpid()}")
        command = [compiler, "-O3", "-march=native", *extra, "-fopenmp", "-shared", "-fPIC", "-o", str(partial),
                   str(SOURCE)]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise KQuantUnavailable(f"building the k-quant kernel failed: {err}") from err
        if result.returncode != 0:
            raise KQuantUnavailable(f"building the k-quant kernel failed: {(result.stderr or '?').splitlines()[0]}")
        partial.rename(built)
    _LIBRARY = _declare(ctypes.CDLL(str(built)))
    return _LIBRARY


class Part(ctypes.Structure):
    """kquant.c's Part: one row block of a map, in one kind (KIND), with its first column in the output."""
    _fields_ = [("kind", ctypes.c_int64), ("rows", ctypes.c_int64), ("column", ctypes.c_int64),
                ("values", ctypes.c_void_p), ("high", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("mins", ctypes.c_void_p), ("d", ctypes.c_void_p), ("dmin", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


KIND = {"q4k": 0, "q6k": 1, "q5_0": 2, "q8_0": 3}  # kquant.c's KIND_*


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.scratch_bytes.argtypes, lib.scratch_bytes.restype = [i64, i64], i64
    lib.linear_forward.argtypes, lib.linear_forward.restype = [p, i64, i64, p, i64, p, i64, i32, p], None
    return lib


def available() -> bool:
    """Whether the kernel builds and loads here."""
    try:
        library()
    except (KQuantUnavailable, OSError, subprocess.SubprocessError):
        return False
    return True


def supported(out_features: int, in_features: int) -> bool:
    """Whether a weight of this shape can be held in k-quant blocks (whole super-blocks of 256 inputs)."""
    return in_features % QK == 0 and out_features > 0


def block_supported(out_features: int, in_features: int) -> bool:
    """Whether a weight of this shape can be held in Q5_0 / Q8_0 blocks (whole blocks of 32 inputs)."""
    return in_features % QK0 == 0 and out_features > 0


# --- weights ---------------------------------------------------------------------------------------------------

@dataclass
class KQuantWeight:
    """One weight [out, in] in GGUF blocks, laid out for kquant.c. kind "q4k": values = nibbles [out, in / 2],
    scales / mins [out, in / 32] uint8, d / dmin [out, in / 256] float32; kind "q6k": values = the low 4 bits of
    each value [out, in / 2] and high = its high 2 bits [out, in / 4], packed as the GGUF packs them (q6k_values),
    scales [out, in / 16] int8, d [out, in / 256]; kind "q5_0": values = nibbles [out, in / 2] (per block of 32,
    byte j holds input j low and j + 16 high), high = fifth bits [out, in / 8] (bit j of a block's 4 bytes: input
    j), d [out, in / 32]; kind "q8_0": values [out, in] int8, d [out, in / 32]. Block kinds have no scales."""

    kind: str
    values: torch.Tensor
    scales: torch.Tensor | None
    d: torch.Tensor
    mins: torch.Tensor | None = None
    dmin: torch.Tensor | None = None
    high: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.values.shape[0]

    @property
    def in_features(self) -> int:
        return self.values.shape[1] * (1 if self.kind == "q8_0" else 2)

    @classmethod
    def of(cls, kind: str, tensors: dict[str, torch.Tensor]) -> KQuantWeight:
        """A weight of `kind` from its named tensors (as tensors() names them)."""
        return cls(kind, **{"scales": None} | tensors)

    def tensors(self) -> dict[str, torch.Tensor]:
        if self.kind in BLOCK_KINDS:
            return {"values": self.values, "d": self.d} | ({"high": self.high} if self.kind == "q5_0" else {})
        named = {"values": self.values, "scales": self.scales, "d": self.d}
        if self.kind == "q4k":
            return named | {"mins": self.mins, "dmin": self.dmin}
        return named | {"high": self.high}

    def dequantized(self) -> torch.Tensor:
        """The dense weight [out, in] (float32) these blocks hold."""
        n, k = self.out_features, self.in_features
        if self.kind in BLOCK_KINDS:
            q = q5_0_values(self.values, self.high).float() - 16 if self.kind == "q5_0" else self.values.float()
            return (self.d[..., None] * q.reshape(n, k // QK0, QK0)).reshape(n, k)
        if self.kind == "q4k":
            nibbles = self.values.reshape(n, k // 64, 32)
            q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(n, k // 32, 32).float()
            d = self.d.repeat_interleave(8, dim=1)
            dmin = self.dmin.repeat_interleave(8, dim=1)
            w = d[..., None] * self.scales.float()[..., None] * q - (dmin * self.mins.float())[..., None]
            return w.reshape(n, k)
        q = q6k_values(self.values, self.high).reshape(n, k // 16, 16).float() - 32
        d = self.d.repeat_interleave(16, dim=1)
        return (d[..., None] * self.scales.float()[..., None] * q).reshape(n, k)


def q6k_values(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Q6_K's values 0..63 [out, in] (uint8, input order) from their packed low 4 bits [out, in / 2] and high 2
    bits [out, in / 4]: per half super-block of 128, low byte l holds values l and l + 64 (low, high nibble), low
    byte l + 32 values l + 32 and l + 96, high byte l the high bits of all four, 2 bits each (ggml's layout)."""
    n = low.shape[0]
    ql, qh = low.reshape(n, -1, 2, 64), high.reshape(n, -1, 2, 32)
    low_bits = torch.cat([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], dim=-1)
    high_bits = torch.cat([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-1)
    return (low_bits | (high_bits << 4)).reshape(n, -1)


def q6k_packed(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of q6k_values: values 0..63 [out, in] -> (low bits [out, in / 2], high bits [out, in / 4])."""
    n = values.shape[0]
    v = values.reshape(n, -1, 2, 4, 32)  # super-block, half, quarter, 32
    low = torch.cat([(v[..., 0, :] & 0x0F) | ((v[..., 2, :] & 0x0F) << 4),
                     (v[..., 1, :] & 0x0F) | ((v[..., 3, :] & 0x0F) << 4)], dim=-1)
    high = (v[..., 0, :] >> 4) | ((v[..., 1, :] >> 4) << 2) | ((v[..., 2, :] >> 4) << 4) | ((v[..., 3, :] >> 4) << 6)
    return low.reshape(n, -1).contiguous(), high.reshape(n, -1).contiguous()


def q5_0_values(nibbles: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Q5_0's values 0..31 [out, in] (uint8, input order) from its nibbles [out, in / 2] and fifth bits [out, in / 8]
    (per block of 32: nibble byte j holds inputs j and j + 16; bit j of the block's 4 high bytes, input j)."""
    n = nibbles.shape[0]
    q = nibbles.reshape(n, -1, 16)
    low = torch.cat([q & 0x0F, q >> 4], dim=-1)  # [out, blocks, 32]
    bits = high.reshape(n, -1, 4, 1) >> torch.arange(8, dtype=torch.uint8)  # byte i, bit j -> input 8i + j
    return (low | ((bits & 1).reshape(n, -1, 32) << 4)).reshape(n, -1)


def q5_0_packed(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of q5_0_values: values 0..31 [out, in] -> (nibbles [out, in / 2], fifth bits [out, in / 8])."""
    n = values.shape[0]
    v = values.reshape(n, -1, 32)
    nibbles = (v[..., :16] & 0x0F) | ((v[..., 16:] & 0x0F) << 4)
    bits = ((v >> 4) & 1).reshape(n, -1, 4, 8) << torch.arange(8, dtype=torch.uint8)
    return nibbles.reshape(n, -1).contiguous(), bits.sum(dim=-1, dtype=torch.uint8).reshape(n, -1).contiguous()


def _as_blocks(raw: np.ndarray, out_features: int, block_bytes: int) -> np.ndarray:
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(out_features, -1, block_bytes)


def q4k_from_gguf(raw: np.ndarray, out_features: int) -> KQuantWeight:
    """A GGUF Q4_K tensor's raw bytes (block_q4_K: half d, half dmin, 12 bytes of packed 6-bit scales and mins,
    128 bytes of nibbles) for a weight of `out_features` rows, unpacked into kquant.c's layout."""
    blocks = _as_blocks(raw, out_features, Q4K_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 4:16].astype(np.uint8)
    scales, mins = np.empty(packed.shape[:-1] + (8,), np.uint8), np.empty(packed.shape[:-1] + (8,), np.uint8)
    scales[..., :4], mins[..., :4] = packed[..., 0:4] & 63, packed[..., 4:8] & 63  # ggml's get_scale_min_k4
    scales[..., 4:] = (packed[..., 8:12] & 0x0F) | ((packed[..., 0:4] >> 6) << 4)
    mins[..., 4:] = (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)
    return KQuantWeight("q4k", torch.from_numpy(blocks[..., 16:].reshape(out_features, -1).copy()),
                        torch.from_numpy(scales.reshape(out_features, -1)), torch.from_numpy(d),
                        torch.from_numpy(mins.reshape(out_features, -1)), torch.from_numpy(dmin))


def q6k_from_gguf(raw: np.ndarray, out_features: int) -> KQuantWeight:
    """A GGUF Q6_K tensor's raw bytes (block_q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales,
    half d) in kquant.c's layout: the bits as stored, scales and d (as float) apart."""
    blocks = _as_blocks(raw, out_features, Q6K_BLOCK_BYTES)
    low = blocks[..., 0:128].reshape(out_features, -1).copy()
    high = blocks[..., 128:192].reshape(out_features, -1).copy()
    scales = blocks[..., 192:208].copy().view(np.int8).reshape(out_features, -1)
    d = blocks[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
    return KQuantWeight("q6k", torch.from_numpy(low), torch.from_numpy(scales), torch.from_numpy(d),
                        high=torch.from_numpy(high))


def q5_0_from_gguf(raw: np.ndarray, out_features: int) -> KQuantWeight:
    """A GGUF Q5_0 tensor's raw bytes (block_q5_0: half d, 4 bytes of fifth bits, 16 bytes of nibbles)."""
    blocks = _as_blocks(raw, out_features, Q5_0_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    high = blocks[..., 2:6].reshape(out_features, -1).copy()
    nibbles = blocks[..., 6:22].reshape(out_features, -1).copy()
    return KQuantWeight("q5_0", torch.from_numpy(nibbles), None, torch.from_numpy(d), high=torch.from_numpy(high))


def q8_0_from_gguf(raw: np.ndarray, out_features: int) -> KQuantWeight:
    """A GGUF Q8_0 tensor's raw bytes (block_q8_0: half d, 32 int8)."""
    blocks = _as_blocks(raw, out_features, Q8_0_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    values = blocks[..., 2:34].copy().view(np.int8).reshape(out_features, -1)
    return KQuantWeight("q8_0", torch.from_numpy(values), None, torch.from_numpy(d))


def _round_scales(per_block: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sub-block factors [out, nb, subs] (>= 0) as `top`-level integers times one float per super-block."""
    d = (per_block.amax(dim=-1) / top).clamp(min=1e-12)
    levels = torch.round(per_block / d[..., None]).clamp(0, top)
    return levels, d


def q4k_from_dense(weight: torch.Tensor) -> KQuantWeight:
    """Round-to-nearest Q4_K blocks of a dense weight [out, in] (in % 256 == 0): for a model with no GGUF source
    (the embedded tiny pair, tests). Asymmetric per 32 inputs; scales and mins in 6 bits per super-block."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // QK, 8, 32)
    low = w.amin(dim=-1).clamp(max=0)
    step = ((w.amax(dim=-1) - low) / 15).clamp(min=1e-12)
    scales, d = _round_scales(step, 63)
    mins, dmin = _round_scales(-low, 63)
    effective_step = (d[..., None] * scales).clamp(min=1e-12)
    q = torch.round((w + (dmin[..., None] * mins)[..., None]) / effective_step[..., None]).clamp(0, 15).to(torch.uint8)
    q = q.reshape(n, k // 64, 2, 32)
    nibbles = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2)
    return KQuantWeight("q4k", nibbles.contiguous(), scales.to(torch.uint8).reshape(n, -1), d.contiguous(),
                        mins.to(torch.uint8).reshape(n, -1), dmin.contiguous())


def q6k_from_dense(weight: torch.Tensor) -> KQuantWeight:
    """Round-to-nearest Q6_K blocks of a dense weight [out, in] (in % 256 == 0): symmetric per 16 inputs, int8
    scales per super-block."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // QK, 16, 16)
    step = w.abs().amax(dim=-1) / 31
    d = (step.amax(dim=-1) / 127).clamp(min=1e-12)
    scales = torch.round(step / d[..., None]).clamp(1, 127)
    q = torch.round(w / (d[..., None] * scales)[..., None]).clamp(-32, 31) + 32
    low, high = q6k_packed(q.to(torch.uint8).reshape(n, k))
    return KQuantWeight("q6k", low, scales.to(torch.int8).reshape(n, -1).contiguous(), d.contiguous(), high=high)


def q5_0_from_dense(weight: torch.Tensor) -> KQuantWeight:
    """Q5_0 blocks of a dense weight [out, in] (in % 32 == 0) as llama.cpp rounds them (quantize_row_q5_0_ref): per
    32 inputs d = (the value of largest magnitude) / -16, q = min(31, floor(w / d + 16.5)), d kept as float16."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // QK0, QK0)
    d = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True)) / -16
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.floor(w * inverse + 16.5).clamp(max=31).to(torch.uint8).reshape(n, k)
    nibbles, high = q5_0_packed(q)
    return KQuantWeight("q5_0", nibbles, None, d[..., 0].half().float().contiguous(), high=high)


def q8_0_from_dense(weight: torch.Tensor) -> KQuantWeight:
    """Round-to-nearest Q8_0 blocks of a dense weight [out, in] (in % 32 == 0): d = max|w| / 127 per 32 inputs."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // QK0, QK0)
    d = w.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.round(w / d.clamp(min=1e-30)).clamp(-127, 127).to(torch.int8).reshape(n, k)
    return KQuantWeight("q8_0", q, None, d[..., 0].contiguous())


def concatenated(weights: list[KQuantWeight]) -> KQuantWeight:
    """Weights of one kind and input size stacked by output rows (a fused q/k/v or gate/up)."""
    first = weights[0]
    if len(weights) == 1:
        return first
    stacked = {name: torch.cat([w.tensors()[name] for w in weights]) for name in first.tensors()}
    return KQuantWeight.of(first.kind, stacked)


# --- the map ----------------------------------------------------------------------------------------------------

class KQuantLinear(nn.Module):
    """`x @ Wᵀ (+ bias)` for W held as consecutive row blocks ("parts") in GGUF blocks, each part in one kind
    (q/k/v fused where the GGUF keeps v in Q6_K and q, k in Q4_K); one C call per forward (kquant.c linear_forward)
    quantizes the activations once and runs every part. Output in `dtype`. The parts' description for the kernel
    (their tensors' addresses) is made once (a decode step makes ~200 such calls); the map holds its tensors, so the
    addresses stay valid for as long as it lives (a copied or moved map would need them rebuilt)."""

    def __init__(self, parts: list[KQuantWeight], bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.in_features = parts[0].in_features
        self.kinds = [part.kind for part in parts]
        block = QK if set(self.kinds) & set(SUPER_BLOCK_KINDS) else QK0
        if any(part.in_features != self.in_features for part in parts) or self.in_features % block:
            raise ValueError(f"k-quant parts need one input size divisible by {block}; got "
                             f"{[part.in_features for part in parts]}")
        self.offsets = np.cumsum([0] + [part.out_features for part in parts]).tolist()
        self.out_features = self.offsets[-1]
        for index, part in enumerate(parts):
            for name, tensor in part.tensors().items():
                self.register_buffer(f"part{index}_{name}", tensor.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.dtype = dtype
        self.lib = library()
        # the kernel's description of the parts, made once: a decode step calls ~200 maps, each one C call
        self._parts = (Part * len(parts))(*(self._part_struct(index) for index in range(len(parts))))
        self._scratch_per_row = self.lib.scratch_bytes(1, self.in_features) + 64

    def _part_struct(self, index: int) -> Part:
        part, start = self.part(index), self.offsets[index]
        pointers = {name: tensor.data_ptr() for name, tensor in part.tensors().items()}
        return Part(KIND[part.kind], part.out_features, start, pointers["values"], pointers.get("high"),
                    pointers.get("scales"), pointers.get("mins"), pointers["d"], pointers.get("dmin"),
                    None if self.bias is None else self.bias.data_ptr() + 4 * start)

    def part(self, index: int) -> KQuantWeight:
        names = ("values", "scales", "d", "mins", "dmin", "high")
        return KQuantWeight(self.kinds[index], *(getattr(self, f"part{index}_{name}", None) for name in names))

    def dequantized(self) -> torch.Tensor:
        """The dense weight [out, in] (float32) this map multiplies by (activations are quantized on top)."""
        return torch.cat([self.part(i).dequantized() for i in range(len(self.kinds))])

    def rows(self, ids: torch.Tensor) -> KQuantLinear:
        """A map of these output rows only, in this order (blocks copied; one part): a pruned LM head (FR-Spec,
        EvoSpec) reads the blocks of its vocabulary's rows, not the dense rows."""
        if len(self.kinds) != 1:
            raise ValueError("rows() takes the rows of a one-part map (an LM head)")
        part = self.part(0)
        picked = {name: tensor.index_select(0, ids) for name, tensor in part.tensors().items()}
        bias = None if self.bias is None else self.bias.index_select(0, ids)
        return KQuantLinear([KQuantWeight.of(part.kind, picked)], bias, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        m = rows.shape[0]
        out = torch.empty(m, self.out_features, dtype=torch.float32)
        scratch = torch.empty(m * self._scratch_per_row, dtype=torch.uint8)  # the activations' int8 blocks
        self.lib.linear_forward(rows.data_ptr(), m, self.in_features, self._parts, len(self.kinds), out.data_ptr(),
                                self.out_features, torch.get_num_threads(), scratch.data_ptr())
        if self.dtype != torch.float32:
            out = out.to(self.dtype)
        return out.view(*x.shape[:-1], self.out_features)
