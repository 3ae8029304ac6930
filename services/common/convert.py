"""Internal protocol (evospec.internal.v1) <-> core conversions, shared by both ends of the speculation stream. A
session starts with the request's public sampling and speculation messages (services/common/messages.py, the one
mapping between those and the typed config)."""
from __future__ import annotations

import numpy as np
import torch

from evospec.adapt.signal import TeacherSignal
from evospec.config import SpecParams
from evospec.engine.drafter import DraftRequest
from evospec.errors import InvalidRequestError
from evospec.services.common.messages import sampling_from_proto, sampling_to_proto, spec_from_proto, spec_to_proto
from evospec.services.protocol.v1 import speculation_pb2 as spec_pb
from evospec.tree import DraftTree
from evospec.verify import VerifyResult
from evospec.vocab.dynamic import SlotChange


def start_to_proto(session_id: str, request: DraftRequest) -> spec_pb.StartSession:
    return spec_pb.StartSession(session_id=session_id, prompt_token_ids=request.prompt_ids,
                                sampling=sampling_to_proto(request.sampling), spec=spec_to_proto(request.spec),
                                seed=request.seed, max_len=request.max_len)


def start_from_proto(start: spec_pb.StartSession) -> DraftRequest:
    """Validated like a public request (the draft trusts no caller's sizes); errors name the internal field."""
    sampling = sampling_from_proto(start.sampling, "start.sampling")
    spec = spec_from_proto(start.spec, SpecParams(), "start.spec")  # the target sends every field
    if not start.prompt_token_ids:
        raise InvalidRequestError("start.prompt_token_ids", "is empty")
    return DraftRequest(list(start.prompt_token_ids), sampling, spec, start.max_len, start.seed)


def reply_to_proto(tree: DraftTree | None, changes: list[SlotChange]) -> spec_pb.SessionReply:
    """A session's buffer changes and, when it drafted one, its tree."""
    msg = spec_pb.SessionReply(buffer_changes=[slot_change_to_proto(c) for c in changes])
    if tree is not None:
        msg.token_ids.extend(tree.token_ids.tolist())
        msg.parents.extend(tree.parents.tolist())
        for node, probs in tree.draft_probs.items():
            msg.draft_probs.add(node=node, probs=probs.float().cpu().tolist())
    return msg


def slot_change_to_proto(change: SlotChange) -> spec_pb.SlotChange:
    return spec_pb.SlotChange(slot=change.slot, token_id=change.token_id, source=change.source)


def tree_from_proto(msg: spec_pb.SessionReply, active_ids: torch.Tensor | None,
                    device: torch.device | str = "cpu") -> DraftTree:
    """The tree as the target's verification expects it, like an in-process draft's: token ids and parents on the
    CPU, the draft distributions and A's ids on the target's `device` (the boundary where wire data meets it)."""
    probs = {row.node: torch.tensor(row.probs, dtype=torch.float32, device=device) for row in msg.draft_probs}
    return DraftTree(torch.tensor(list(msg.token_ids), dtype=torch.long),
                     torch.tensor(list(msg.parents), dtype=torch.long), probs,
                     active_ids.to(device) if probs else None)


def outcome_to_proto(result: VerifyResult, candidates: dict[int, float],
                     teacher: TeacherSignal | None = None) -> spec_pb.Outcome:
    return spec_pb.Outcome(
        accepted_nodes=result.accepted_nodes, accepted_tokens=result.accepted_tokens, bonus_token=result.bonus_token,
        buffer_candidates=[spec_pb.BufferCandidate(token_id=t, score=s) for t, s in candidates.items()],
        teacher=teacher_to_proto(teacher) if teacher is not None else None)


def outcome_from_proto(o: spec_pb.Outcome) -> tuple[VerifyResult, dict[int, float], TeacherSignal | None]:
    if len(o.accepted_nodes) != len(o.accepted_tokens):
        raise InvalidRequestError("outcome.accepted_nodes", f"{len(o.accepted_nodes)} nodes but "
                                                            f"{len(o.accepted_tokens)} accepted tokens")
    result = VerifyResult(list(o.accepted_nodes), list(o.accepted_tokens), o.bonus_token)
    teacher = teacher_from_proto(o.teacher) if o.HasField("teacher") else None
    if teacher is not None and teacher.positions != len(result.committed_tokens):
        raise InvalidRequestError("outcome.teacher", f"has {teacher.positions} positions; the outcome commits "
                                                     f"{len(result.committed_tokens)} tokens")
    return result, {c.token_id: c.score for c in o.buffer_candidates}, teacher


def teacher_to_proto(signal: TeacherSignal) -> spec_pb.TeacherSignal:
    """ids row-major as varints, log-probabilities as raw little-endian float16 (2 bytes each)."""
    return spec_pb.TeacherSignal(k=signal.token_ids.shape[1], token_ids=signal.token_ids.flatten().tolist(),
                                 logprobs=signal.logprobs.contiguous().numpy().astype("<f2").tobytes())


def teacher_from_proto(msg: spec_pb.TeacherSignal) -> TeacherSignal:
    k, n = msg.k, len(msg.token_ids)
    if k == 0 or n % k or len(msg.logprobs) != 2 * n:
        raise InvalidRequestError("outcome.teacher", f"k={k}, {n} ids and {len(msg.logprobs)} log-probability "
                                                     f"bytes do not form positions x k float16 rows")
    ids = np.fromiter(msg.token_ids, dtype=np.int64, count=n)
    if n and int(ids.max()) >= 2**31:
        raise InvalidRequestError("outcome.teacher.token_ids", "ids must be vocabulary ids (below 2^31)")
    logprobs = np.frombuffer(msg.logprobs, dtype="<f2").astype(np.float32)
    if np.isnan(logprobs).any() or (logprobs == np.inf).any():
        raise InvalidRequestError("outcome.teacher.logprobs", "log-probabilities must be numbers (no NaN or +inf)")
    return TeacherSignal(torch.from_numpy(ids.astype(np.int32)).view(-1, k),
                         torch.from_numpy(logprobs.astype(np.float16)).view(-1, k))


def session_op_to_proto(session_id: str, kind: str, request: DraftRequest | None = None,
                        result: VerifyResult | None = None, candidates: dict[int, float] | None = None,
                        teacher: TeacherSignal | None = None) -> spec_pb.SessionOp:
    if kind == "start":
        return spec_pb.SessionOp(session_id=session_id, start=start_to_proto(session_id, request))
    if kind == "outcome":
        return spec_pb.SessionOp(session_id=session_id, outcome=outcome_to_proto(result, candidates or {}, teacher))
    return spec_pb.SessionOp(session_id=session_id, close=True)


def session_op_from_proto(op: spec_pb.SessionOp):
    """-> (session id, kind, request, result, candidates, teacher); a StartSession is validated like
    `start_from_proto`."""
    kind = op.WhichOneof("op")
    if kind is None:
        raise InvalidRequestError("ops.op", "set one of start, outcome or close")
    if kind == "start":
        return op.session_id, kind, start_from_proto(op.start), None, None, None
    if kind == "outcome":
        return op.session_id, kind, None, *outcome_from_proto(op.outcome)
    return op.session_id, kind, None, None, None, None
