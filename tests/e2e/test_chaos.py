"""Chaos on the two-node service (orchestration/chaos.py, shorter than `evospec chaos`): a frozen or killed draft
replica never breaks a stream, speculation comes back, and a killed target replica gives clients UNAVAILABLE without
internals, fails new calls within 1 s while it restarts, and is back within 30 s. These run after every other e2e test (conftest orders the `chaos` marker last)."""
import pytest
from ray import serve

from evospec.orchestration import chaos
from evospec.services.target.ingress import TARGET_RESTARTING

pytestmark = [pytest.mark.e2e, pytest.mark.chaos, pytest.mark.timeout(600)]

MAX_TOKENS = 96


def scrape_metrics(service) -> dict[str, float]:
    import urllib.request

    from evospec.testing import prometheus_values
    with urllib.request.urlopen(f"http://127.0.0.1:{service[1].http_port}/metrics", timeout=30) as r:
        return prometheus_values(r.read().decode())


@pytest.fixture(scope="module")
def references(client):
    """Target-only greedy outputs of the prompts the scenarios stream (4 streams per method use the first 4); the
    calm τ per method (`evospec chaos` reports how far a kill moved it) is not asserted here, so not measured."""
    return chaos.greedy_references(client, chaos.PROMPTS[:4], MAX_TOKENS, methods=())


def test_draft_and_target_run_on_different_nodes(service):
    app = service[1].app_name
    draft = serve.get_deployment_handle("Draft", app).placement.remote().result(timeout_s=30)
    target = serve.get_deployment_handle("Target", app).placement.remote().result(timeout_s=30)
    assert draft["node_id"] != target["node_id"]
    assert "draft_node" in draft["resources"] and "target_node" in target["resources"]


def test_a_frozen_draft_stalls_no_stream(client, service, references):
    figures = chaos.draft_freeze(client, service[1].app_name, references, streams_per_method=4,
                                 max_tokens=MAX_TOKENS, freeze_s=3.0)
    assert figures["speculating_before_fault"] == 12, figures  # else "identical to ar" would prove nothing
    assert figures["completed"] == figures["streams"] == 12, figures
    assert figures["greedy_identical"] == 12, figures
    assert figures["fell_back"] > 0 and figures["resumed"] > 0, figures  # the freeze hit streams in flight
    # The draft's step deadline (1 s) plus a step bounds a stall, not the 3 s freeze (2.16 s measured on a slow day).
    assert figures["longest_gap_s"] < 2.5, figures
    assert figures["speculation_back_after_thaw_s"] < 30, figures


def test_a_killed_draft_breaks_no_stream_and_speculation_returns(client, service, references):
    """Every stream speculated before the kill, none breaks, all stay greedy-identical; afterwards speculation is
    back (drafted > 0, no step without a draft) for a single new stream and for as many at once, and /metrics
    counts the requests the kill sent target-only and shows none still without their draft."""
    before = scrape_metrics(service)
    figures = chaos.draft_kill(client, service[1].app_name, references, streams_per_method=4, max_tokens=MAX_TOKENS)
    assert figures["speculating_before_fault"] == 12, figures  # else "identical to ar" would prove nothing
    assert figures["completed"] == figures["streams"] == 12, figures
    assert figures["greedy_identical"] == 12, figures
    assert figures["fell_back"] > 0 and figures["errors"] == [], figures  # the kill hit streams in flight
    assert figures["speculation_back_after_healthy_s"] < 30, figures
    assert figures["speculation_back_under_load_s"] < 30, figures
    after = scrape_metrics(service)
    without_draft = [k for k in after if k.startswith("evospec:requests_without_draft_total")]
    assert sum(after[k] - before.get(k, 0) for k in without_draft) >= figures["fell_back"], figures
    assert after["evospec:num_requests_running_without_draft|reason=draft_unavailable"] == 0


def test_a_killed_target_gives_clients_unavailable_without_internals(client, service):
    figures = chaos.target_kill(client, service[1].app_name, streams=4, max_tokens=MAX_TOKENS * 4)
    assert figures["error_codes"] == ["UNAVAILABLE"], figures  # the kill hit streams in flight, as UNAVAILABLE only
    assert figures["leaking_internals"] == 0, figures
    assert figures["answers_again_after_s"] < 30, figures
    # New calls while no replica runs fail fast with UNAVAILABLE (the SDK's retry then applies), not at their
    # deadline; the call that succeeds was not held through the restart either.
    assert figures["failed_new_call_codes"] == ["UNAVAILABLE"], figures
    assert figures["slowest_failed_new_call_s"] <= 1.0, figures
    assert figures["answering_call_s"] < 5, figures
    # Meanwhile grpc.health.v1 Check answered NOT_SERVING with why, never an error status.
    assert f"NOT_SERVING: {TARGET_RESTARTING}" in figures["health_answers"], figures
    assert set(figures["health_answers"]) <= {"SERVING", f"NOT_SERVING: {TARGET_RESTARTING}"}, figures


def test_a_dead_scheduler_thread_gets_its_replica_replaced_and_clients_unavailable(client, service):
    """The replica's process lives but its engine thread is gone: the health predicate fails, Serve replaces the
    replica (health_check_period_s 2 s in this suite), and clients saw only UNAVAILABLE "target restarting, retry"."""
    figures = chaos.target_engine_death(client, service[1].app_name, streams=4, max_tokens=MAX_TOKENS * 4)
    assert figures["error_codes"] == ["UNAVAILABLE"], figures
    assert all(e == "UNAVAILABLE: target restarting, retry" for e in figures["errors"]), figures
    assert figures["leaking_internals"] == 0, figures
    assert figures["replaced_after_s"] < 60 and figures["answers_again_after_s"] < 90, figures
