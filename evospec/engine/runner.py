"""The thread that runs a target replica's scheduler: its lifecycle and its health, apart from the step pipeline
(scheduler.py), which tests and benchmarks also step by hand.

The thread waits while nothing runs or waits, then steps the scheduler again and again. A step that raises fails the
requests it hit, never the thread. If the thread itself ends on an unexpected error, it fails everything and closes
the queue with "target restarting, retry", and `health` says so, so that Serve replaces the replica. `stop` closes
the queue ("shutting down") and fails whatever is still there.
"""
from __future__ import annotations

import logging
import threading
import time

from evospec.engine.scheduler import Scheduler
from evospec.errors import EngineStoppedError, ShuttingDownError

log = logging.getLogger(__name__)


def shutting_down() -> ShuttingDownError:
    return ShuttingDownError("the server is shutting down; retry on another replica")


def engine_stopped() -> EngineStoppedError:
    return EngineStoppedError("target restarting, retry")


class SchedulerThread:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self._thread: threading.Thread | None = None
        self._step_started: float | None = None  # time.monotonic() while the thread is inside a step (health)

    def start(self) -> SchedulerThread:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="evospec-scheduler", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Refuse new requests, fail whatever still runs or waits ('shutting down') and end the thread."""
        self.scheduler.waiting.close(shutting_down)
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    @property
    def running(self) -> bool:
        """The thread runs and the scheduler takes new requests."""
        return self._thread is not None and self._thread.is_alive() and self.scheduler.waiting.closed is None

    def health(self) -> str | None:
        """Why this replica's engine cannot serve (None = it can): its thread ended or is stopping, or one engine step
        has run past `stall_timeout_s`. The target's one health predicate: Serve's check_health, the gRPC health
        service and GET /health all read it."""
        if self._thread is None or not self._thread.is_alive():
            return "the scheduler thread is not running"
        if self.scheduler.waiting.closed is not None:
            return "shutting down"
        started, limit = self._step_started, self.scheduler.config.stall_timeout_s
        if started is not None and time.monotonic() - started > limit:
            return (f"one engine step has run for {time.monotonic() - started:.0f} s "
                    f"(scheduler.stall_timeout_s = {limit:g})")
        return None

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - the thread ends here (logged): nothing may wait for it forever
            log.critical("the scheduler thread stopped", exc_info=exc)
            self.scheduler.waiting.close(engine_stopped)
            self.scheduler.fail_everything(engine_stopped())

    def _idle(self) -> bool:
        return not len(self.scheduler.waiting) and not self.scheduler.num_running()

    def _serve(self) -> None:
        scheduler, waiting = self.scheduler, self.scheduler.waiting
        while True:
            if self._idle() and scheduler.drafter is not None:
                scheduler.flush_drafter()  # the closes of the last step's sessions reach the draft now
            with waiting.changed:
                while self._idle() and waiting.closed is None:
                    waiting.changed.wait()
            if waiting.closed is not None:
                break
            self._step_started = time.monotonic()
            try:
                scheduler.step()
            except Exception as exc:  # noqa: BLE001 - a bug must fail the requests it hit, never hang them all
                log.exception("scheduler step failed")
                scheduler.fail_everything(exc, waiting=False)
            self._step_started = None
        scheduler.fail_everything(waiting.closed())
