"""gRPC front of the draft server: one bidirectional `Speculate` stream per generation (evospec.internal.v1).

Runs on a plain `grpc.server` (thread pool) inside the draft replica: each stream's handler thread owns its session,
so torch work for different generations runs in parallel threads and the stream costs ~0.2 ms per message. It only
converts messages and delegates to `DraftServer`.
"""
from __future__ import annotations

import logging
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc

from evospec.errors import InvalidRequestError
from evospec.services.common.convert import outcome_from_proto, start_from_proto, tree_to_proto
from evospec.services.common.errors import set_status
from evospec.services.config import INTERNAL_CHANNEL_OPTIONS
from evospec.services.draft.server import DraftReply, DraftServer
from evospec.services.protocol.v1 import speculation_pb2 as spec_pb
from evospec.services.protocol.v1 import speculation_pb2_grpc as spec_grpc

log = logging.getLogger(__name__)


def reply_to_proto(reply: DraftReply) -> spec_pb.DraftToTarget:
    msg = tree_to_proto(reply.tree, reply.changes)
    msg.head_seconds = reply.head_seconds
    msg.buffer_update_seconds = reply.buffer_update_seconds
    return msg


class DraftServicer(spec_grpc.DraftServicer):
    def __init__(self, server: DraftServer):
        self.server = server

    def Speculate(self, request_iterator, context):
        # A server-side key: two callers reusing a session id can never share (or close) each other's session.
        key = uuid.uuid4().hex
        session_id = None
        try:
            first = next(request_iterator, None)
            if first is None or first.WhichOneof("kind") != "start":
                raise InvalidRequestError("start", "the first message of a Speculate stream must be StartSession")
            session_id = first.start.session_id
            first_tree = reply_to_proto(self.server.open(key, start_from_proto(first.start)))
            first_tree.static_vocab_sha = self.server.static_vocab_sha
            yield first_tree
            for msg in request_iterator:
                if msg.WhichOneof("kind") != "outcome":
                    raise InvalidRequestError("outcome", "every message after StartSession must be an Outcome")
                if msg.outcome.finished:
                    break
                yield reply_to_proto(self.server.step(key, *outcome_from_proto(msg.outcome)))
        except Exception as exc:  # one status per failure, never a crash of the server
            if not isinstance(exc, InvalidRequestError):
                log.exception("draft stream %s failed", session_id)
            set_status(context, exc)
        finally:
            self.server.close(key)


def start_draft_server(server: DraftServer, host: str, max_workers: int = 64) -> tuple[grpc.Server, int]:
    """Plain gRPC server for the internal stream; port 0 = any free port. Returns (server, port)."""
    grpc_server = grpc.server(ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="draft-stream"),
                              options=INTERNAL_CHANNEL_OPTIONS)
    spec_grpc.add_DraftServicer_to_server(DraftServicer(server), grpc_server)
    port = grpc_server.add_insecure_port(f"{host}:0")
    grpc_server.start()
    return grpc_server, port
