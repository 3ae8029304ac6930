"""Proto <-> core conversions. Servicers only convert and delegate; validation errors name the proto field."""
from __future__ import annotations

import torch

from evospec.api.evospec.v1 import generate_pb2 as gen_pb
from evospec.api.evospec.v1 import speculation_pb2 as spec_pb
from evospec.config import SamplingParams, SpecParams, TreeParams, VocabParams, validated
from evospec.engine.stats import SpecStats
from evospec.errors import InvalidRequestError
from evospec.tokenizer import chat_prompt_ids
from evospec.tree import DraftTree
from evospec.verify import VerifyResult
from evospec.vocab.dynamic import SlotChange


def _present(msg, name: str) -> bool:
    return msg.HasField(name)


def sampling_from_proto(p: gen_pb.SamplingParams) -> SamplingParams:
    values = {"top_k": p.top_k, "ignore_eos": p.ignore_eos}
    for name in ("max_tokens", "temperature", "top_p", "seed"):
        if _present(p, name):
            values[name] = getattr(p, name)
    try:
        return validated(SamplingParams, **values)
    except InvalidRequestError as e:
        raise InvalidRequestError(f"sampling.{e.field}", e.message) from None


def sampling_to_proto(s: SamplingParams) -> gen_pb.SamplingParams:
    p = gen_pb.SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                              ignore_eos=s.ignore_eos)
    if s.seed is not None:
        p.seed = s.seed
    return p


def spec_from_proto(p: gen_pb.SpecParams, defaults: SpecParams) -> SpecParams:
    tree = defaults.tree.model_dump()
    if p.tree.shape:
        tree["shape"] = p.tree.shape
    for name in ("num_draft_tokens", "depth", "branching", "budget"):
        if p.tree.HasField(name):
            tree[name] = getattr(p.tree, name)
    vocab = defaults.vocab.model_dump()
    for name in ("static_size", "dynamic_size"):
        if p.HasField(name):
            vocab[name] = getattr(p, name)
    if p.retrieval:
        vocab["retrieval"] = tuple(p.retrieval)
    try:
        return validated(SpecParams, method=p.method or defaults.method,
                         tree=validated(TreeParams, **tree), vocab=validated(VocabParams, **vocab))
    except InvalidRequestError as e:
        raise InvalidRequestError(f"spec.{e.field}", e.message) from None


def spec_to_proto(s: SpecParams) -> gen_pb.SpecParams:
    t = s.tree
    return gen_pb.SpecParams(method=s.method, static_size=s.vocab.static_size, dynamic_size=s.vocab.dynamic_size,
                             retrieval=list(s.vocab.retrieval),
                             tree=gen_pb.TreeParams(shape=t.shape, num_draft_tokens=t.num_draft_tokens,
                                                    depth=t.depth, branching=t.branching, budget=t.budget))


def prompt_ids_from_request(req: gen_pb.GenerateRequest, tokenizer) -> list[int]:
    kind = req.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError("input", "set one of prompt, prompt_token_ids or chat")
    if kind == "prompt":
        if not req.prompt:
            raise InvalidRequestError("prompt", "is empty")
        return tokenizer(req.prompt, add_special_tokens=False)["input_ids"]
    if kind == "prompt_token_ids":
        return list(req.prompt_token_ids.ids)
    messages = [{"role": m.role, "content": m.content} for m in req.chat.messages]
    if not messages:
        raise InvalidRequestError("chat.messages", "is empty")
    bad = [m["role"] for m in messages if m["role"] not in ("system", "user", "assistant")]
    if bad:
        raise InvalidRequestError("chat.messages.role", f"must be system, user or assistant; got {bad[0]!r}")
    return chat_prompt_ids(tokenizer, messages, req.chat.enable_thinking)


def stats_to_proto(stats: SpecStats, method: str, ttft: float, e2e: float) -> gen_pb.SpecStats:
    return gen_pb.SpecStats(steps=stats.steps, drafted=stats.drafted, accepted=stats.accepted,
                            accepted_per_pos=stats.accepted_per_pos, tau=stats.tau, alpha=stats.alpha,
                            prompt_tokens=stats.prompt_tokens, generated_tokens=stats.generated_tokens,
                            draft_seconds=stats.draft_seconds, verify_seconds=stats.verify_seconds,
                            misses=stats.misses, miss_rate=stats.miss_rate, buffer_updates=stats.buffer_updates,
                            ttft_seconds=ttft, e2e_seconds=e2e, method=method)


# ---- internal protocol ----

def tree_to_proto(tree: DraftTree, changes: list[SlotChange]) -> spec_pb.DraftToTarget:
    msg = spec_pb.DraftToTarget(token_ids=tree.token_ids.tolist(), parents=tree.parents.tolist(),
                                buffer_changes=[spec_pb.SlotChange(slot=c.slot, token_id=c.token_id) for c in changes])
    for node, probs in tree.draft_probs.items():
        msg.draft_probs.add(node=node, probs=probs.float().cpu().tolist())
    return msg


def tree_from_proto(msg: spec_pb.DraftToTarget, active_ids: torch.Tensor) -> DraftTree:
    probs = {row.node: torch.tensor(row.probs, dtype=torch.float32) for row in msg.draft_probs}
    return DraftTree(torch.tensor(list(msg.token_ids), dtype=torch.long),
                     torch.tensor(list(msg.parents), dtype=torch.long), probs, active_ids if probs else None)


def outcome_to_proto(result: VerifyResult, candidates: dict[int, float], misses: int) -> spec_pb.TargetToDraft:
    return spec_pb.TargetToDraft(outcome=spec_pb.Outcome(
        accepted_nodes=result.accepted_nodes, accepted_tokens=result.accepted_tokens, bonus_token=result.bonus_token,
        misses=misses, buffer_candidates=[spec_pb.BufferCandidate(token_id=t, score=s) for t, s in candidates.items()]))


def outcome_from_proto(o: spec_pb.Outcome) -> tuple[VerifyResult, dict[int, float], int]:
    result = VerifyResult(list(o.accepted_nodes), list(o.accepted_tokens), o.bonus_token)
    return result, {c.token_id: c.score for c in o.buffer_candidates}, o.misses
