"""Transport-free draft server: the draft engine, the vocabulary policies and the open sessions of one replica.

The gRPC servicer (services/draft/servicer.py) converts the internal stream's messages and calls `open`, `step`
and `close`; a future batched or multiplexed front calls the same methods.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from evospec.engine.draft import DraftEngine, DraftSession
from evospec.engine.drafter import DraftRequest
from evospec.errors import InvalidRequestError
from evospec.loading import apply_torch_threads, load_cooc, load_model, load_static_ids
from evospec.services.config import DraftServiceConfig
from evospec.tree import DraftTree
from evospec.verify import VerifyResult
from evospec.vocab.dynamic import SlotChange
from evospec.vocab.registry import VocabPolicies
from evospec.vocab.retrieval import TargetFeedback


@dataclass
class DraftReply:
    """One tree for the target, with the buffer slot changes applied before drafting it and the session's totals."""
    tree: DraftTree
    changes: list[SlotChange]
    head_seconds: float  # draft LM-head time so far
    buffer_update_seconds: float  # draft-side buffer update time so far


@dataclass
class _Session:
    draft: DraftSession
    update_seconds: float = 0.0


class DraftServer:
    def __init__(self, engine: DraftEngine, policies: VocabPolicies, static_vocab_sha: str = "",
                 model_name: str = ""):
        self.engine = engine
        self.policies = policies
        self.static_vocab_sha = static_vocab_sha
        self.model_name = model_name
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()  # sessions are opened and closed from the stream server's threads

    @classmethod
    def from_config(cls, cfg: DraftServiceConfig) -> "DraftServer":
        apply_torch_threads(cfg.model.torch_threads)
        model, folder = load_model(cfg.model, "draft")
        static_ids, sha = load_static_ids(cfg.static_vocab)
        policies = VocabPolicies(model.head_weight, static_ids, load_cooc(cfg.cooc))
        return cls(DraftEngine(model), policies, sha, str(Path(folder)))

    def num_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def open(self, session_id: str, request: DraftRequest) -> DraftReply:
        """Start a session (prefill happens in the first propose) and draft its first tree."""
        if request.spec.method == "ar":
            raise InvalidRequestError("start.vocab.method", "'ar' drafts nothing; it never opens a draft session")
        draft = self.engine.start(request.prompt_ids, request.sampling, request.spec.tree,
                                  self.policies.get(request.spec), request.max_len, request.seed)
        session = _Session(draft)
        with self._lock:
            if session_id in self._sessions:
                raise InvalidRequestError("start.session_id", f"{session_id!r} is already open")
            self._sessions[session_id] = session
        return self._reply(session, draft.vocab.initial_changes)

    def step(self, session_id: str, result: VerifyResult, candidates: dict[int, float]) -> DraftReply:
        """Commit the verified step, update the buffer (target-fed candidates first), draft the next tree."""
        session = self._get(session_id)
        start = time.perf_counter()
        changes = self.engine.advance(session.draft, result, TargetFeedback(0, 0, candidates))
        session.update_seconds += time.perf_counter() - start
        return self._reply(session, changes)

    def close(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    def _get(self, session_id: str) -> _Session:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise InvalidRequestError("session_id", f"{session_id!r} is not open")
        return session

    def _reply(self, session: _Session, changes: list[SlotChange]) -> DraftReply:
        tree = self.engine.propose(session.draft)
        return DraftReply(tree, changes, session.draft.head_seconds, session.update_seconds)
