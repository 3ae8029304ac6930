"""Is a verify forward of k rows bitwise what k one-row decode forwards give, on this machine? (issue 39, item 3)

Greedy speculative output equals `ar`'s only if the target gives each position the same logits in a k-token verify
forward as in the 1-token forward `ar` runs; a kernel whose rounding depends on the row count breaks that on a
near-tie. This diagnostic measures it, per dtype, in two places:

- each linear map of a Qwen2.5-Coder-1.5B-shaped target (hidden 1536, MLP 8960, a slice of the 151,936-row head),
  k = 2/5/8/16 rows against the same rows one at a time, three ways: `F.linear` as the model runs it, weight-first
  (`kernels/linear.py`'s other order), and every call padded to a fixed block of 16 rows (one kernel, one row count,
  whatever the number of real rows), with each way's cost for 1 and 5 rows;
- the whole forward of a random model of that shape (2 layers, full head), through the model's own linear maps
  (`kernels/linear.py`, operand order as measured here): the logits of every row of a k-token chain after a
  prefix, against k 1-token decodes of the same tokens; and the same with the usual operand order forced.

    python -m evospec.bench.batch_invariance [--dtypes bfloat16 float32] [--layers 2] [--repeats 5]

Prints the CPU, one line per (dtype, shape) and one per (dtype, k); a diagnostic, not a product setting.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics

import torch

from evospec.bench.harness import run_ms
from evospec.kernels import linear
from evospec.kernels.tree import chain_then_tree_mask
from evospec.model.qwen3 import Qwen3Config
from evospec.model.weight_formats import ROW_INVARIANT, apply_weight_format
from evospec.testing import random_qwen3

HIDDEN, MLP, HEAD_SLICE = 1536, 8960, 151936 // 8
SHAPES = ((HIDDEN, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP), (HEAD_SLICE, HIDDEN))  # [out, in]
ROWS = (2, 5, 8, 16)
BLOCK = 16


def padded_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weightᵀ computed in blocks of exactly BLOCK rows (the last one zero-padded)."""
    blocks = []
    for start in range(0, x.shape[0], BLOCK):
        block = x[start:start + BLOCK]
        real = block.shape[0]
        if real < BLOCK:
            block = torch.cat([block, block.new_zeros(BLOCK - real, block.shape[1])])
        blocks.append(torch.nn.functional.linear(block, weight)[:real])
    return torch.cat(blocks)


WAYS = {"F.linear": torch.nn.functional.linear, "weight-first": lambda x, w: (w @ x.T).T.contiguous(),
        f"padded-{BLOCK}": padded_linear}


def linear_invariance(out: int, inp: int, dtype: torch.dtype, repeats: int, rows=ROWS) -> dict:
    """{way: {"invariant": [bool per k], "ms_1": ..., "ms_5": ...}} for one weight shape."""
    weight = (torch.randn(out, inp) / inp ** 0.5).to(dtype)
    x = torch.randn(max(rows), inp).to(dtype)
    result = {}
    for name, way in WAYS.items():
        invariant = [bool(torch.equal(way(x[:k], weight), torch.cat([way(x[i:i + 1], weight) for i in range(k)])))
                     for k in rows]
        result[name] = {"invariant": invariant,
                        "ms_1": statistics.median(run_ms(lambda: way(x[:1], weight), repeats)),
                        "ms_5": statistics.median(run_ms(lambda: way(x[:5], weight), repeats))}
    return result


def forward_invariance(dtype: torch.dtype, layers: int, rows=ROWS[:3], prefix: int = 32, hidden: int = HIDDEN,
                       mlp: int = MLP, vocab: int = 151936, weight_format: str = "none",
                       pad_single_token: bool = False) -> dict[int, float]:
    """{k: max |Δ logit|} between a k-token chain forward (a verify) and k 1-token forwards of the same tokens one
    after the other (`ar`'s decode), every row, after the same `prefix` tokens, on a random Qwen2 model of the 1.5B
    target's layer shapes by default, in `weight_format` (model/weight_formats.py; 0.0 = bitwise equal).
    pad_single_token: the 1-token forwards run padded to two rows, as the served model may (Qwen3.forward_packed)."""
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                      num_attention_heads=12, num_key_value_heads=2, head_dim=hidden // 12,
                      max_position_embeddings=4096, attention_bias=True, qk_norm=False, tie_word_embeddings=False)
    model = apply_weight_format(random_qwen3(cfg, seed=0, dtype=dtype), weight_format, None)
    model.pad_single_token = pad_single_token
    ids = torch.randint(0, cfg.vocab_size, (prefix + max(rows),), generator=torch.Generator().manual_seed(1))

    def logits(k: int, step: int) -> torch.Tensor:
        """The k tokens after the prefix, `step` at a time, each forward's rows committed before the next."""
        cache = model.new_cache(prefix + k + 1)  # + 1: the scratch slot a padded single token writes
        model(ids[:prefix], torch.arange(prefix), cache, chain_then_tree_mask(0, prefix, None))
        cache.length = prefix
        out = []
        for start in range(prefix, prefix + k, step):
            hidden = model(ids[start:start + step], torch.arange(start, start + step), cache,
                           chain_then_tree_mask(start, step, None))
            cache.length = start + step
            out.append(model.full_logits(hidden).float())
        return torch.cat(out)
    return {k: float((logits(k, k) - logits(k, 1)).abs().max()) for k in rows}


@contextlib.contextmanager
def operand_order(weight_first: bool | None):
    """Within the block, `kernels/linear.py` uses weight-first (True) or the usual order (False) for every product
    of 2+ rows instead of its measured choice (None: leave the choice alone)."""
    if weight_first is None:
        yield
        return
    measured = linear.weight_first
    linear.weight_first = lambda weight: weight_first
    try:
        yield
    finally:
        linear.weight_first = measured


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the random model (its shapes: 1.5B's)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from evospec.loading import cpu_description
    print(f"{cpu_description()}; torch.backends.cpu.get_cpu_capability() = {torch.backends.cpu.get_cpu_capability()}"
          f"; {torch.get_num_threads()} threads; k = {ROWS}; ms: median of {args.repeats}")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for out, inp in SHAPES:
            cells = [f"{way} invariant {r['invariant']} 1 row {r['ms_1']:.2f} ms, 5 rows {r['ms_5']:.2f} ms"
                     for way, r in linear_invariance(out, inp, dtype, args.repeats).items()]
            print(f"{name} {out}x{inp}: " + "; ".join(cells), flush=True)
        for order, forced in (("as measured", None), ("usual order forced", False)):
            with operand_order(forced):
                deltas = forward_invariance(dtype, args.layers)
            for k, delta in deltas.items():
                print(f"{name} whole forward ({args.layers} layers, full head, linear order {order}): {k} rows vs "
                      f"{k} 1-row decodes, max |Δ logit| = {delta:.3g}" + (" (bitwise equal)" if delta == 0 else ""),
                      flush=True)
        for weight_format in ROW_INVARIANT:
            deltas = forward_invariance(dtype, args.layers, weight_format=weight_format)
            for k, delta in deltas.items():
                print(f"{name} whole forward ({args.layers} layers, {weight_format}): {k} rows vs {k} 1-row decodes, "
                      f"max |Δ logit| = {delta:.3g}" + (" (bitwise equal)" if delta == 0 else ""), flush=True)
        print(f"{name} operand orders measured: {linear.linear_orders()}", flush=True)


if __name__ == "__main__":
    main()
