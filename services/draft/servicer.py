"""gRPC front of the draft server (evospec.internal.v1): `SpeculateBatch`, one multiplexed stream per target
replica carrying every session of its engine steps.

Runs on a plain `grpc.server` (thread pool) inside the draft replica: each stream's handler thread owns its sessions,
so different target replicas' work runs in parallel threads and a message costs ~0.2 ms. It only converts messages
and delegates to `DraftServer`.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2_grpc

from evospec.errors import InvalidRequestError, OverloadedError
from evospec.services.common.auth import BearerAuthInterceptor
from evospec.services.common.convert import reply_to_proto, session_op_from_proto
from evospec.services.common.errors import public_details, set_status, status_for
from evospec.services.common.health import PredicateHealthServicer
from evospec.services.config import INTERNAL_CHANNEL_OPTIONS, InternalStreamConfig
from evospec.services.draft.server import DraftServer, Op, SessionStep
from evospec.services.protocol.v1 import speculation_pb2 as spec_pb
from evospec.services.protocol.v1 import speculation_pb2_grpc as spec_grpc

log = logging.getLogger(__name__)


class IdleWatch:
    """Closes streams that have sent nothing for `timeout_s` (a caller that went away without closing, or holds a
    stream open to tie up the server), so their sessions are freed. Its thread runs only while streams are open."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._last: dict[object, float] = {}  # context -> monotonic time of its last message
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def touch(self, context) -> None:
        with self._lock:
            self._last[context] = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="draft-idle-watch", daemon=True)
                self._thread.start()

    def forget(self, context) -> None:
        with self._lock:
            self._last.pop(context, None)

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            now = time.monotonic()
            with self._lock:
                if not self._last:
                    self._thread = None
                    return
                stale = [c for c, last in self._last.items() if now - last > self.timeout_s]
                for context in stale:
                    del self._last[context]  # cancelled once; its handler ends and frees its sessions
            for context in stale:
                log.warning("closing a speculation stream idle for over %.0f s", self.timeout_s)
                context.cancel()


class Backlog:
    """Messages received and not yet taken, over every stream of this server: one stream's pre-drafting stops as soon
    as any stream has a message waiting (it may be another target replica's critical path)."""

    def __init__(self):
        self._count = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self._count += n

    def waiting(self) -> bool:
        return self._count > 0


class Inbox:
    """A stream's incoming messages, read ahead on a thread into a bounded queue, so that the handler can pre-draft
    while it waits and stop as soon as a message is there. Errors of the call re-raise in the handler."""

    _END = object()

    def __init__(self, request_iterator, backlog: Backlog, bound: int = 8):
        self._queue: queue.Queue = queue.Queue(maxsize=bound)  # the target sends <= 2 messages per step it reads
        self._backlog = backlog
        self._closed = False
        self._lock = threading.Lock()  # a message is counted in the backlog exactly while it is queued
        threading.Thread(target=self._read, args=(request_iterator,), name="draft-stream-inbox", daemon=True).start()

    def _read(self, request_iterator) -> None:
        try:
            for msg in request_iterator:
                self._put(msg)
            self._put(self._END)
        except Exception as exc:  # noqa: BLE001 - the call failed or was cancelled: the handler raises it
            self._put(exc)

    def _put(self, item) -> None:
        while True:  # never blocks forever on a handler that has gone
            with self._lock:
                if self._closed:
                    return
                try:
                    self._queue.put_nowait(item)
                except queue.Full:
                    pass
                else:
                    self._backlog.add(1)
                    return
            time.sleep(0.005)

    def __iter__(self):
        while True:
            item = self._queue.get()
            self._backlog.add(-1)
            if item is self._END:
                return
            if isinstance(item, Exception):
                raise item
            yield item

    def close(self) -> None:
        with self._lock:
            self._closed = True
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    return
                self._backlog.add(-1)


class DraftServicer(spec_grpc.DraftServicer):
    def __init__(self, server: DraftServer, limits: InternalStreamConfig = InternalStreamConfig()):
        self.server = server
        self.limits = limits
        self.idle = IdleWatch(limits.idle_timeout_s)
        self.backlog = Backlog()

    def SpeculateBatch(self, request_iterator, context):
        # Session ids are the caller's keys, namespaced per stream: callers cannot reach each other's sessions.
        prefix = uuid.uuid4().hex + "/"
        opened: set[str] = set()
        predraft_seconds = 0.0  # pre-drafting since the last reply: reported with the next one
        inbox = Inbox(request_iterator, self.backlog)
        self.idle.touch(context)
        try:
            for msg in inbox:
                self.idle.touch(context)
                start = time.perf_counter()
                ops, bad = [], {}
                for op in msg.ops:
                    sid = prefix + op.session_id
                    try:
                        _, kind, request, result, candidates, teacher = session_op_from_proto(op)
                        if kind == "start" and sid not in opened and \
                                len(opened) >= self.limits.max_sessions_per_stream:
                            raise OverloadedError(f"this stream holds {len(opened)} sessions (max_sessions_per_"
                                                  f"stream={self.limits.max_sessions_per_stream})")
                    except (InvalidRequestError, OverloadedError) as exc:  # ends this session only; in the reply
                        ops.append(Op(sid, "close"))
                        bad[sid] = exc
                        continue
                    ops.append(Op(sid, kind, request, result, candidates, teacher))
                    if kind == "start":
                        opened.add(sid)
                    elif kind == "close":
                        opened.discard(sid)
                work = {prefix + w.session_id: (w.depth, w.prefill_tokens) for w in msg.work}
                computing = time.perf_counter()
                steps = self.server.run_step(ops, work)
                encoding = time.perf_counter()
                for sid, exc in bad.items():
                    steps.setdefault(sid, SessionStep()).error = exc
                reply = spec_pb.DraftStep(sessions=[session_to_proto(sid[len(prefix):], step)
                                                    for sid, step in steps.items()],
                                          static_vocab_sha=self.server.static_vocab_sha,
                                          teacher_top_k=self.server.teacher_top_k,
                                          compute_seconds=encoding - computing, predraft_seconds=predraft_seconds)
                reply.codec_seconds = computing - start + time.perf_counter() - encoding
                yield reply
                # Sent: the target verifies these trees now, and the draft pre-drafts their likeliest outcomes.
                start = time.perf_counter()
                self.server.predraft([sid for sid, step in steps.items() if step.tree is not None],
                                     self.backlog.waiting)
                predraft_seconds = time.perf_counter() - start
        except grpc.RpcError:
            pass  # the caller cancelled or went away (or the idle watch closed the stream): nobody to tell
        except Exception as exc:  # noqa: BLE001 - one status per failure, never a crash of the server
            set_status(context, exc, prefix)
        finally:
            inbox.close()
            self.idle.forget(context)
            for sid in opened:
                self.server.close(sid)


def session_to_proto(session_id: str, step: SessionStep) -> spec_pb.SessionDraft:
    if step.error is not None:
        code = status_for(step.error)
        if code == grpc.StatusCode.INTERNAL:  # its details stay here: the target may show the reason to clients
            log.error("draft session %s failed", session_id, exc_info=step.error)
        return spec_pb.SessionDraft(session_id=session_id, error=public_details(step.error, session_id),
                                    error_code=code.name)
    reply = reply_to_proto(step.tree, step.changes)
    reply.head_seconds, reply.buffer_update_seconds = step.head_seconds, step.buffer_update_seconds
    return spec_pb.SessionDraft(session_id=session_id, reply=reply, has_tree=step.tree is not None,
                                predrafted=step.predrafted)


class DraftStreamServer:
    """The draft replica's plain gRPC server: the SpeculateBatch stream and standard health on `host` only (port 0 =
    any free port), every call authenticated with `limits.secret` when set. Its `health` is the Draft deployment's one
    health predicate: Serve's check_health raises on it, and the health service target replicas probe before they
    send sessions here answers from it."""

    def __init__(self, server: DraftServer, host: str, limits: InternalStreamConfig = InternalStreamConfig()):
        self.server = server
        self._stopped = False
        interceptors = [BearerAuthInterceptor(limits.secret)] if limits.secret else []
        # One thread per call in flight; calls beyond max_streams get RESOURCE_EXHAUSTED at once instead of queueing.
        self.grpc_server = grpc.server(
            ThreadPoolExecutor(max_workers=limits.max_streams + 1, thread_name_prefix="draft-stream"),
            options=INTERNAL_CHANNEL_OPTIONS, interceptors=interceptors, maximum_concurrent_rpcs=limits.max_streams)
        spec_grpc.add_DraftServicer_to_server(DraftServicer(server, limits), self.grpc_server)
        health_pb2_grpc.add_HealthServicer_to_server(PredicateHealthServicer(self.health), self.grpc_server)
        self.port = self.grpc_server.add_insecure_port(f"{host}:0")
        self.grpc_server.start()

    def health(self) -> str | None:
        """None while this replica can draft: its stream server runs and its draft server is open."""
        if self._stopped:
            return "the speculation stream server stopped"
        return self.server.health()

    def stop(self, grace: float | None = None) -> None:
        self._stopped = True
        self.grpc_server.stop(grace)


def start_draft_server(server: DraftServer, host: str, limits: InternalStreamConfig = InternalStreamConfig()
                       ) -> tuple[DraftStreamServer, int]:
    """Start a DraftStreamServer; returns (it, its port)."""
    stream = DraftStreamServer(server, host, limits)
    return stream, stream.port
