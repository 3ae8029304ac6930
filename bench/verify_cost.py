"""The two implementations of batched verification side by side on this machine (evospec/verify.py): `verify_each`
(the per-tree reference, which the engine takes on a CPU) and `verify_on_device` (batch-first, which it takes on an
accelerator), on random trees over Qwen3's vocabulary with a 32k active set; and likewise the step's vocabulary
feedback (evospec/vocab/retrieval.py): `target_feedback` request by request against `feedbacks_on_device`.

    python -m evospec.bench.verify_cost [--device cpu|cuda] [--repeats 5]

Prints ms per step (median, min, max) for greedy and sampled batches of several sizes, then for the feedback.
"""
from __future__ import annotations

import argparse
import random

import torch

from evospec.bench.harness import run_ms
from evospec.config import SamplingParams
from evospec.testing import random_feedback_batch
from evospec.tree import DraftTree
from evospec.verify import verify_each, verify_on_device
from evospec.vocab.retrieval import feedbacks_on_device, target_feedback

VOCAB, ACTIVE = 151936, 32768
SIZES = ((1, 8), (4, 8), (16, 16))  # (trees, nodes per tree)
FEEDBACK_SIZES = (1, 8, 32)  # requests


def random_step(rng: random.Random, trees: int, nodes: int, greedy: bool, device: torch.device):
    batch, rows = [], []
    for _ in range(trees):
        parents = [-1] + [rng.randrange(-1, i) for i in range(1, nodes)]
        tree = DraftTree(torch.randint(0, VOCAB, (nodes,)), torch.tensor(parents))
        if not greedy:
            tree.active_ids = torch.arange(ACTIVE, device=device)
            tree.draft_probs = {p: torch.softmax(torch.randn(ACTIVE, device=device), -1) for p in set(parents)}
        batch.append(tree)
        rows.append(torch.randn(1 + nodes, VOCAB, device=device))
    return batch, torch.cat(rows), [SamplingParams(temperature=0.0 if greedy else 0.8)] * trees


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    device, rng = torch.device(args.device), random.Random(0)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    print(f"device {device}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads; ms per verify step: median (min-max) of {args.repeats}")
    for greedy in (True, False):
        for trees, nodes in SIZES:
            step = random_step(rng, trees, nodes, greedy, device)
            cells = [f"{verify.__name__} " + timed(lambda: verify(*step, [
                torch.Generator(device=device).manual_seed(i) for i in range(trees)]), device, args.repeats)
                for verify in (verify_each, verify_on_device)]
            print(f"{'greedy' if greedy else 'sampled'} {trees} x {nodes}: " + ", ".join(cells))
    for requests in FEEDBACK_SIZES:
        logits, committed, masks, wanted = random_feedback_batch(requests, requests, vocab=VOCAB)
        step = ([rows.to(device) for rows in logits], committed, [mask.to(device) for mask in masks], wanted)
        per_request = timed(lambda: [target_feedback(*args) for args in zip(*step)], device, args.repeats)
        batched = timed(lambda: feedbacks_on_device(*step), device, args.repeats)
        print(f"feedback {requests} requests: target_feedback each {per_request}, feedbacks_on_device {batched}")


def timed(fn, device: torch.device, repeats: int) -> str:
    """median (min-max) ms of `repeats` runs after one untimed one."""
    times = run_ms(fn, repeats, device)
    return f"{times[len(times) // 2]:.2f} ({times[0]:.2f}-{times[-1]:.2f})"


if __name__ == "__main__":
    main()
