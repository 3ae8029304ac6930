"""DraftLease: a generation's draft session state and the fallback/resume decisions (evospec/engine/lease.py)."""
import time

from evospec.engine.lease import DraftLease, plan_catch_up
from evospec.engine.stats import SpecStats


class Permanent(Exception):
    retryable = False


def test_failures_back_off_doubling_up_to_the_cap():
    lease = DraftLease(SpecStats(), retry_s=1.0, max_retry_s=3.0)
    lease.opened()
    assert lease.drafting and not lease.due(time.monotonic())
    before = time.monotonic()
    assert lease.lose(RuntimeError("gone\nfor now"))  # it held a session: the caller closes it
    assert not lease.held and not lease.drafting
    assert lease.stats.fallback_reason == "RuntimeError: gone"
    assert not lease.lose(RuntimeError("again"))  # nothing held: nothing to do, no backoff
    delays = [lease.retry_at - before]
    for _ in range(2):  # opening a new session fails twice more
        before = time.monotonic()
        lease.failed(RuntimeError("still gone"))
        delays.append(lease.retry_at - before)
    assert [round(d) for d in delays] == [1, 2, 3]  # 1, 2, then 4 capped at 3
    assert lease.due(lease.retry_at) and not lease.due(lease.retry_at - 0.5)
    lease.answered()
    assert lease.failures == 0


def test_an_error_a_reconnect_cannot_fix_is_never_retried():
    lease = DraftLease(SpecStats(), retry_s=1.0, max_retry_s=3.0)
    lease.failed(Permanent("another static vocabulary"))
    assert not lease.due(lease.retry_at + 100)


def test_a_resumed_session_catches_up_before_it_drafts():
    a, b = DraftLease(SpecStats(), 1.0, 3.0), DraftLease(SpecStats(), 1.0, 3.0)
    a.resumed(context_tokens=11)  # the last token is pending: 10 to prefill
    b.resumed(context_tokens=5)
    assert (a.lag, a.stats.draft_resumes, a.drafting) == (10, 1, False)
    plan = plan_catch_up([("a", a), ("b", b)], room=12)
    assert plan == {"a": 10, "b": 2}
    a.caught_up(plan["a"])
    b.caught_up(plan["b"])
    assert a.drafting and (b.lag, b.drafting) == (2, False)
    assert b.release() and not b.release()  # idempotent: the session is closed once
    b.caught_up(2)
    assert b.lag == 2  # nothing to catch up on without a session
