"""The draft replicas one target replica can reach: found, probed and reconnected in the background.

`DraftReplicas` keeps one gRPC channel per draft replica address. A background thread
  - rediscovers the addresses every `refresh_s` (at once after a failure) with the `discover` callable: through Serve
    it calls the Draft deployment's `address` method until every replica answered (services/target/deployment.py),
    so a restarted or replaced replica (a new address) is found without restarting the target;
  - probes each new or failed replica with standard gRPC health before it takes sessions, with a backoff that doubles
    from `retry_s` to `max_retry_s`, so a frozen or dead replica never stalls an engine step more than once; healthy
    replicas are probed at each refresh too, so one that died while idle takes no new sessions.
The scheduler's thread only reads `healthy()` and reports failures with `mark_failed`; nothing here blocks it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from evospec.services.common.auth import authenticated_channel
from evospec.services.config import INTERNAL_CHANNEL_OPTIONS, DraftLinkConfig
from evospec.services.protocol.v1 import speculation_pb2_grpc as spec_grpc

log = logging.getLogger(__name__)


@dataclass
class StepTiming:
    """How long a draft replica takes to answer an engine step: a moving average for steps without prefill, and
    the extra seconds per prefilled (or caught-up) context token. A reply is late after
    `max(floor_s, SLACK * expected(prefill_tokens))`, never later than `cap_s`: a replica that is slow but alive (a
    big batch, a prefill chunk on a CPU, a cold start) is given its own time; only a dead or frozen one misses it."""
    token_s: float  # prior until measured: config `prefill_token_s`
    floor_s: float = 1.0  # config `step_timeout_s`
    cap_s: float = 10.0  # config `max_step_timeout_s`: no replica stalls a step longer
    step_s: float = 0.0
    SLACK = 3.0

    def deadline_s(self, prefill_tokens: int) -> float:
        return min(self.cap_s, max(self.floor_s, self.SLACK * (self.step_s + prefill_tokens * self.token_s)))

    def late(self, waited_s: float) -> None:
        """A reply missed its deadline after `waited_s`: assume steps take that long until measured otherwise (a
        slow replica then gets its time after one fallback; the average decays back once it answers fast)."""
        self.step_s = min(self.cap_s / self.SLACK, max(self.step_s, waited_s))

    def record(self, seconds: float, prefill_tokens: int) -> None:
        if prefill_tokens == 0:
            self.step_s = seconds if not self.step_s else 0.8 * self.step_s + 0.2 * seconds
        elif self.step_s:
            per_token = max(0.0, seconds - self.step_s) / prefill_tokens
            self.token_s = 0.8 * self.token_s + 0.2 * per_token


@dataclass(eq=False)
class DraftReplica:
    """One draft replica's address and channel, and what the target knows of its health."""
    address: str
    channel: grpc.Channel
    stub: spec_grpc.DraftStub
    timing: StepTiming  # kept across reconnects
    healthy: bool = False  # takes sessions only once a health probe answered SERVING
    failures: int = 0  # failures since its last good step (the backoff's exponent; a health probe does not reset it)
    epoch: int = 0  # bumped by each failure, so a probe that started before one cannot undo it
    retry_at: float = 0.0  # monotonic time of the next probe while unhealthy
    reason: str = "not probed yet"


class DraftReplicas:
    def __init__(self, discover: Callable[[], Iterable[str]], link: DraftLinkConfig = DraftLinkConfig()):
        """discover: the draft replicas' current addresses (may raise; bounded in time by its own timeouts)."""
        self.discover, self.link = discover, link
        self._replicas: dict[str, DraftReplica] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._refresh_due = True
        self._thread = threading.Thread(target=self._run, name="draft-link", daemon=True)
        self._thread.start()

    # ---- what the scheduler's thread uses -----------------------------------------------------------------------
    def healthy(self) -> list[DraftReplica]:
        with self._lock:
            return [r for r in self._replicas.values() if r.healthy]

    def mark_failed(self, replica: DraftReplica, reason: str) -> None:
        """The replica broke a stream or missed a step deadline: no new sessions until a probe answers again."""
        with self._lock:
            if replica.healthy:
                log.warning("draft replica %s failed: %s", replica.address, reason)
            self._set_failed(replica, reason)
            self._refresh_due = True  # it may have been replaced: rediscover now
            self._wake.notify_all()

    def mark_ok(self, replica: DraftReplica) -> None:
        """The replica answered a step in time: its backoff starts over."""
        with self._lock:
            replica.failures = 0

    def wait_healthy(self, count: int = 1, timeout_s: float = 30.0) -> bool:
        """Block until `count` replicas are healthy (start-up, tests); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._refresh_due = True
            self._wake.notify_all()
            while sum(r.healthy for r in self._replicas.values()) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return False
                self._wake.wait(min(remaining, 0.05))
        return True

    def describe(self) -> list[dict]:
        """Each replica's address, health and last failure (operators, tests)."""
        with self._lock:
            return [{"address": r.address, "healthy": r.healthy, "failures": r.failures, "reason": r.reason}
                    for r in self._replicas.values()]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            replicas = list(self._replicas.values())
            self._replicas.clear()
        self._thread.join(timeout=self.link.probe_timeout_s * 4 + 1)  # a discovery round, then one probe
        for replica in replicas:
            replica.channel.close()

    # ---- the background thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        last_refresh = -float("inf")
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                interval = self.link.refresh_s if self._replicas else self.link.retry_s  # start-up: look often
                refresh = self._refresh_due or now - last_refresh >= interval
                due = [r for r in self._replicas.values() if not r.healthy and r.retry_at <= now]
                if not refresh and not due:
                    next_probe = min((r.retry_at for r in self._replicas.values() if not r.healthy), default=now + 1e9)
                    self._wake.wait(max(0.01, min(last_refresh + interval, next_probe) - now))
                    continue
                self._refresh_due = False
            if refresh:
                last_refresh = time.monotonic()
                self._rediscover()
                for replica in self.healthy():  # one that died while idle must not take the next sessions
                    self._probe(replica)
                continue  # probes of what it found happen in the next round
            for replica in due:
                self._probe(replica)

    def _rediscover(self) -> None:
        try:
            addresses = set(self.discover())
        except Exception as exc:  # noqa: BLE001 - Serve busy or restarting: keep what we know, try again later
            log.warning("draft discovery failed: %s", exc)
            return
        with self._lock:
            if self._closed:
                return
            for address in addresses:
                if address not in self._replicas:
                    channel = authenticated_channel(address, self.link.secret, INTERNAL_CHANNEL_OPTIONS)
                    timing = StepTiming(token_s=self.link.prefill_token_s, floor_s=self.link.step_timeout_s,
                                        cap_s=self.link.max_step_timeout_s)
                    self._replicas[address] = DraftReplica(address, channel, spec_grpc.DraftStub(channel), timing)
            # A failed replica that discovery no longer lists is gone for good (Serve replaced it).
            gone = [r for r in self._replicas.values() if not r.healthy and r.address not in addresses]
            for replica in gone:
                del self._replicas[replica.address]
                replica.channel.close()

    def _probe(self, replica: DraftReplica) -> None:
        epoch = replica.epoch
        try:
            reply = health_pb2_grpc.HealthStub(replica.channel).Check(health_pb2.HealthCheckRequest(),
                                                                      timeout=self.link.probe_timeout_s)
            ok = reply.status == health_pb2.HealthCheckResponse.SERVING
            reason = "" if ok else f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
        except grpc.RpcError as err:
            ok, reason = False, f"health probe: {err.code().name}"
        with self._lock:
            if ok and replica.epoch != epoch:
                pass  # it failed a step while the probe ran: that failure stands
            elif ok:
                if not replica.healthy and replica.failures:
                    log.warning("draft replica %s answers its health probe again", replica.address)
                replica.healthy, replica.reason = True, ""
            else:
                if replica.healthy:
                    log.warning("draft replica %s failed its health probe: %s", replica.address, reason)
                self._set_failed(replica, reason)
            self._wake.notify_all()  # wait_healthy

    def _set_failed(self, replica: DraftReplica, reason: str) -> None:
        replica.healthy = False
        replica.epoch += 1
        replica.reason = reason
        replica.failures += 1
        replica.retry_at = time.monotonic() + min(self.link.max_retry_s,
                                                  self.link.retry_s * 2 ** (replica.failures - 1))
