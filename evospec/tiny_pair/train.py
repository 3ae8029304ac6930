"""Train the embedded tiny Qwen3 pair (target ~4 layers/hidden 256, draft 1 layer/hidden 128) on CPU.

    python -m evospec.tiny_pair.train            # ~10-15 CPU-minutes on 2 cores; writes evospec/tiny_pair/weights/

Choices (why):
- Real Qwen3 tokenizer, so token statistics (FR-Spec frequencies, long-tail medical tokens) are the real ones.
- Training runs over the token ids that occur in the corpus only ("seen" rows). Every other row of the 151,936-row
  tied embedding is one shared learned vector `unseen_row`, so the loss treats them as one pseudo-class of
  multiplicity N_unseen (logit h·u + log N_unseen): the trained objective *is* the full-vocabulary cross-entropy.
  (Zero rows would get logit 0 and a tiny model cannot raise its seen logits above log N_unseen ≈ 11.7 fast enough:
  a first run with zero rows left 30% of the mass on never-seen rows; a learned shared row drives it to ~0.)
  The script reports that mass on held-out text.
- The draft is trained with cross-entropy plus distillation from the target (KL over seen rows), which raises
  draft/target agreement, the quantity speculative decoding lives on.
- Weights are stored compactly (fp16, seen rows only + their ids); `evospec.tiny_pair.ensure_hf_folders` expands them
  into standard Hugging Face folders (config.json + model.safetensors with all 151,936 rows).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from evospec.datasets import icd10_descriptions, kjv_verses, medical_chat, spec_bench_prompts, split_pubmedqa
from evospec.tiny_pair import DRAFT_SHAPE, TARGET_SHAPE, WEIGHTS_DIR, hf_config
from evospec.tokenizer import QWEN3_VOCAB_ROWS, chat_special_token_ids, load_tokenizer


def build_documents(tokenizer) -> tuple[list[str], list[str]]:
    """Training and held-out documents as text (chat-formatted where there is a question and an answer)."""
    train_items, held_items = split_pubmedqa()

    def chat(item):
        return tokenizer.apply_chat_template(medical_chat(item), tokenize=False, enable_thinking=False)

    train = [chat(it) for it in train_items]
    train += [" ".join(it["contexts"]) + "<|endoftext|>" for it in train_items]
    icd = icd10_descriptions(limit=12000)
    train += ["\n".join(icd[i:i + 30]) + "<|endoftext|>" for i in range(0, len(icd), 30)]
    for row in spec_bench_prompts():
        train += [t + "<|endoftext|>" for t in row["turns"]]
    kjv = kjv_verses(limit=9000)
    train += [" ".join(kjv[i:i + 25]) + "<|endoftext|>" for i in range(0, len(kjv), 25)]
    held = [chat(it) for it in held_items]
    return train, held


def pack(docs: list[list[int]], seq_len: int, seed: int) -> torch.Tensor:
    """Shuffle documents, concatenate, cut into [num_windows, seq_len + 1] windows."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    stream = [t for i in order for t in docs[i]]
    n = (len(stream) - 1) // seq_len
    return torch.tensor(stream[: n * seq_len + 1]).unfold(0, seq_len + 1, seq_len)


def full_vocab_logsumexp(logits: torch.Tensor, num_unseen: int) -> torch.Tensor:
    """logits: [..., n_seen + 1] (last column = the shared unseen row) -> logsumexp over the full vocabulary [...],
    the unseen column counted `num_unseen` times."""
    return torch.logsumexp(torch.cat([logits[..., :-1], logits[..., -1:] + math.log(num_unseen)], dim=-1), dim=-1)


def seen_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids: [B, T] compact ids -> logits [B, T, n_seen + 1]: seen rows, then the shared unseen row."""
    hidden = model.model(input_ids=input_ids).last_hidden_state
    return hidden @ torch.cat([model.model.embed_tokens.weight, model.unseen_row[None]]).T


def make_model(shape: dict, n_seen: int, seed: int):
    from transformers import Qwen3Config as HFQwen3Config
    from transformers import Qwen3ForCausalLM
    torch.manual_seed(seed)
    cfg = HFQwen3Config(**{**hf_config(shape), "vocab_size": n_seen})
    model = Qwen3ForCausalLM(cfg)
    torch.nn.init.normal_(model.model.embed_tokens.weight, std=0.02)
    model.unseen_row = torch.nn.Parameter(torch.zeros(cfg.hidden_size))  # shared row of every never-seen token
    return model


def train_model(model, windows: torch.Tensor, steps: int, batch: int, lr: float, num_unseen: int, seed: int,
                teacher=None, desc: str = "train") -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    model.train()
    bar = tqdm(range(steps), desc=desc)
    for step in bar:
        for group in opt.param_groups:  # linear warm-up, cosine decay
            group["lr"] = lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))
        idx = torch.randint(0, windows.shape[0], (batch,), generator=gen)
        x, y = windows[idx, :-1], windows[idx, 1:]
        logits = seen_logits(model, x)  # [B, T, n_seen]
        lse = full_vocab_logsumexp(logits, num_unseen)
        ce = (lse - logits.gather(-1, y[..., None])[..., 0]).mean()
        loss = ce
        if teacher is not None:
            with torch.no_grad():
                t_logits = seen_logits(teacher, x)
                t_logprobs = t_logits - full_vocab_logsumexp(t_logits, num_unseen)[..., None]
            s_logprobs = logits - lse[..., None]
            kd = (t_logprobs.exp() * (t_logprobs - s_logprobs)).sum(-1).mean()
            loss = 0.5 * ce + 0.5 * kd
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.set_postfix(ce=f"{ce.item():.3f}")
    model.eval()


@torch.no_grad()
def evaluate(target, draft, windows: torch.Tensor, num_unseen: int) -> dict:
    """Held-out full-vocabulary loss of each model, mass on never-seen rows, draft/target top-1 agreement."""
    out = {}
    t_logits = seen_logits(target, windows[:, :-1])
    d_logits = seen_logits(draft, windows[:, :-1])
    y = windows[:, 1:]
    for name, logits in (("target", t_logits), ("draft", d_logits)):
        lse = full_vocab_logsumexp(logits, num_unseen)
        out[f"{name}_heldout_loss"] = round((lse - logits.gather(-1, y[..., None])[..., 0]).mean().item(), 4)
        unseen_mass = (logits[..., -1] + math.log(num_unseen) - lse).exp()
        out[f"{name}_unseen_mass_mean"] = float(f"{unseen_mass.mean().item():.3g}")
        out[f"{name}_unseen_mass_max"] = float(f"{unseen_mass.max().item():.3g}")
    out["draft_target_top1_agreement"] = round(
        (t_logits[..., :-1].argmax(-1) == d_logits[..., :-1].argmax(-1)).float().mean().item(), 4)
    return out


def compact_state(model, seen_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """fp16 state dict over seen rows (HF names), `seen_token_ids` (compact row i is token seen_ids[i]) and
    `unseen_row` (the row of every other id)."""
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}
    state["seen_token_ids"] = seen_ids.to(torch.int32)
    return state


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=WEIGHTS_DIR)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--target-steps", type=int, default=400)
    ap.add_argument("--draft-steps", type=int, default=260)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    started = time.time()

    tokenizer = load_tokenizer()
    train_docs, held_docs = build_documents(tokenizer)
    encode = lambda docs: [tokenizer(d, add_special_tokens=False)["input_ids"] for d in tqdm(docs, desc="tokenize")]
    train_ids, held_ids = encode(train_docs), encode(held_docs)
    seen = sorted({t for d in train_ids + held_ids for t in d} | set(chat_special_token_ids(tokenizer)))
    seen_ids = torch.tensor(seen)
    to_compact = {t: i for i, t in enumerate(seen)}
    num_unseen = QWEN3_VOCAB_ROWS - len(seen)
    train_windows = pack([[to_compact[t] for t in d] for d in train_ids], args.seq_len, args.seed)
    held_windows = pack([[to_compact[t] for t in d] for d in held_ids], args.seq_len, args.seed)
    print(f"corpus: {sum(map(len, train_ids)):,} train tokens, {sum(map(len, held_ids)):,} held-out tokens, "
          f"{len(seen):,} distinct ids ({num_unseen:,} rows never seen)")

    target = make_model(TARGET_SHAPE, len(seen), args.seed)
    train_model(target, train_windows, args.target_steps, args.batch, args.lr, num_unseen, args.seed, desc="target")
    draft = make_model(DRAFT_SHAPE, len(seen), args.seed + 1)
    train_model(draft, train_windows, args.draft_steps, args.batch, args.lr, num_unseen, args.seed + 1,
                teacher=target, desc="draft")

    args.out.mkdir(parents=True, exist_ok=True)
    save_file(compact_state(target, seen_ids), str(args.out / "target.safetensors"))
    save_file(compact_state(draft, seen_ids), str(args.out / "draft.safetensors"))
    report = {"train_tokens": sum(map(len, train_ids)), "heldout_tokens": sum(map(len, held_ids)),
              "distinct_ids": len(seen), "args": {k: str(v) for k, v in vars(args).items()},
              **evaluate(target, draft, held_windows, num_unseen),
              "train_minutes": round((time.time() - started) / 60, 1)}
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
