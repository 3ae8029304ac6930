"""Draft side of the internal protocol: one bidirectional `Speculate` stream per generation.

Runs on a plain `grpc.server` (thread pool) inside the draft replica: each stream's handler thread owns its session,
so torch work for different generations runs in parallel threads and the stream costs ~0.2 ms per message.
"""
from __future__ import annotations

import logging
import threading

import grpc

from evospec.api.evospec.v1 import speculation_pb2_grpc as spec_grpc
from evospec.config import SpecParams
from evospec.engine.draft import DraftEngine, DraftSession
from evospec.errors import InvalidRequestError
from evospec.vocab.registry import VocabPolicies
from evospec.vocab.retrieval import TargetFeedback
from services.common.convert import outcome_from_proto, sampling_from_proto, spec_from_proto, tree_to_proto
from services.common.errors import set_status

log = logging.getLogger(__name__)


class DraftServicer(spec_grpc.DraftServicer):
    def __init__(self, engine: DraftEngine, policies: VocabPolicies, static_vocab_sha: str = ""):
        self.engine = engine
        self.policies = policies
        self.static_vocab_sha = static_vocab_sha
        self.sessions: dict[str, DraftSession] = {}
        self._lock = threading.Lock()

    def num_sessions(self) -> int:
        with self._lock:
            return len(self.sessions)

    def Speculate(self, request_iterator, context):
        session_id = None
        try:
            first = next(request_iterator, None)
            if first is None or first.WhichOneof("kind") != "start":
                raise InvalidRequestError("start", "the first message of a Speculate stream must be StartSession")
            start = first.start
            session_id = start.session_id
            spec = spec_from_proto(start.spec, SpecParams())
            session = self.engine.start(list(start.prompt_token_ids), sampling_from_proto(start.sampling), spec.tree,
                                        self.policies.get(spec), start.max_len, start.seed)
            with self._lock:
                self.sessions[session_id] = session
            first_tree = tree_to_proto(self.engine.propose(session), session.vocab.initial_changes)
            first_tree.static_vocab_sha = self.static_vocab_sha
            first_tree.static_size = spec.vocab.static_size
            first_tree.head_seconds = session.head_seconds
            yield first_tree
            for msg in request_iterator:
                result, candidates, misses = outcome_from_proto(msg.outcome)
                if msg.outcome.finished:
                    break
                changes = self.engine.advance(session, result, TargetFeedback(misses, 0, candidates))
                reply = tree_to_proto(self.engine.propose(session), changes)
                reply.head_seconds = session.head_seconds
                yield reply
        except Exception as exc:  # one status per failure, never a crash of the server
            if not isinstance(exc, InvalidRequestError):
                log.exception("draft stream %s failed", session_id)
            set_status(context, exc)
        finally:
            if session_id is not None:
                with self._lock:
                    self.sessions.pop(session_id, None)


def start_draft_server(servicer: DraftServicer, host: str, max_workers: int = 64) -> tuple[grpc.Server, int]:
    """Plain gRPC server for the internal stream; port 0 = any free port. Returns (server, port)."""
    from concurrent.futures import ThreadPoolExecutor
    server = grpc.server(ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="draft-stream"),
                         options=[("grpc.max_receive_message_length", 64 << 20),
                                  ("grpc.max_send_message_length", 64 << 20)])
    spec_grpc.add_DraftServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    return server, port
