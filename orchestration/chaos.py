"""Chaos scenarios against the decoupled service: what an operator's bad day does to running streams.

    evospec chaos [--config cpu-tiny.yaml] [--streams 4] [--max-tokens 160] [--freeze-s 5] [--draft-replicas 2]
                  [--json out.json]

starts the service on a private two-node Ray cluster (Target on one node, Draft on the other), with a fixed draft
depth (so that a stream's τ does not depend on load), then
1. freezes a Draft replica's process (SIGSTOP) for longer than the step deadline while streams of every
   speculative method run: every stream must keep producing tokens (longest gap) and finish, greedy-identical to
   `ar`; after the thaw, how long until a new request speculates again;
2. kills a Draft replica (Serve replaces it) while streams run: the same checks, how long after the new replica is
   healthy speculation is back, and, with several draft replicas, how many streams never noticed (no step without
   their draft) and how far their τ moved from a calm run's;
3. kills the Target replica while streams run: what clients see (UNAVAILABLE, no actor ids, pids or namespaces) and
   how long until the service answers again;
4. ends the Target replica's scheduler thread while streams run (the process lives on): the same client-side
   checks, and how long until Serve's health check has replaced the replica.
The e2e suite (tests/e2e/test_chaos.py) runs the same scenarios, shorter, and asserts the issue's goals.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

METHODS = ("sd", "frspec", "evospec")
PROMPTS = ("What are the first-line treatments for hypertension in adults?",
           "Does aspirin reduce the risk of a second stroke?",
           "How is type 2 diabetes diagnosed?",
           "What are the side effects of metformin?",
           "When should antibiotics be used for otitis media in children?",
           "Is vitamin D supplementation useful for bone health in older adults?")
INTERNALS = ("actor", "pid", "namespace", "ray::", "Traceback", "SERVE_REPLICA")


# ---- the cluster side ------------------------------------------------------------------------------------------------
def replica_actors(app: str, deployment: str) -> list:
    """Handles of a deployment's live replica actors."""
    import ray
    actors = []
    for entry in _replica_entries(app, deployment):
        try:
            actors.append(ray.get_actor(entry["name"], namespace=entry["namespace"]))
        except ValueError:
            continue  # died meanwhile
    return actors


def replica_pid(actor) -> int:
    import ray
    return ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=30)


def replica_names(app: str, deployment: str) -> set[str]:
    return {entry["name"] for entry in _replica_entries(app, deployment)}


def _replica_entries(app: str, deployment: str) -> list[dict]:
    """A deployment's live replica actors as Ray lists them (Serve names them SERVE_REPLICA::<app>#<deployment>#<id>)."""
    import ray
    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]


def kill_replica(app: str, deployment: str) -> None:
    import ray
    actors = replica_actors(app, deployment)
    if not actors:
        raise RuntimeError(f"no live {deployment} replica to kill")
    ray.kill(actors[0], no_restart=True)  # Serve's controller notices and starts a replacement


def wait_replaced(app: str, deployment: str, before: set[str], timeout_s: float = 300.0) -> float:
    """Block until a replica that was not among `before` (the names before a kill) runs and Serve reports the
    deployment HEALTHY with every replica RUNNING (the replacement finished starting); returns time.monotonic()."""
    from ray import serve
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        status = serve.status().applications.get(app)
        dep = status.deployments.get(deployment) if status is not None else None
        if dep is not None and dep.status == "HEALTHY" and not set(dep.replica_states) - {"RUNNING"} \
                and replica_names(app, deployment) - before:
            return time.monotonic()
        time.sleep(0.2)
    raise TimeoutError(f"{deployment} not replaced after {timeout_s:.0f}s")


# ---- the client side -------------------------------------------------------------------------------------------------
@dataclass
class StreamResult:
    prompt: str
    method: str
    token_ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    largest_delta: int = 0  # most tokens in one streamed message: > 1 = a step accepted drafted tokens
    finish_reason: str = ""
    stats: dict = field(default_factory=dict)
    error_code: str = ""
    error: str = ""

    @property
    def longest_gap_s(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:])), default=0.0)


def stream_one(client, result: StreamResult, max_tokens: int) -> None:
    try:
        for delta in client.stream(messages=[{"role": "user", "content": result.prompt}], method=result.method,
                                   max_tokens=max_tokens, ignore_eos=True):
            if delta.token_ids:
                result.token_ids += delta.token_ids
                result.times.append(time.monotonic())
                result.largest_delta = max(result.largest_delta, len(delta.token_ids))
            if delta.finish_reason:
                result.finish_reason, result.stats = delta.finish_reason, delta.stats
    except Exception as exc:  # noqa: BLE001 - what the client saw is the figure
        result.error_code = getattr(getattr(exc, "code", None), "name", type(exc).__name__)
        result.error = str(exc)


def start_streams(client, jobs: list[tuple[str, str]], max_tokens: int) -> tuple[list[StreamResult], list]:
    results = [StreamResult(prompt, method) for prompt, method in jobs]
    threads = [threading.Thread(target=stream_one, args=(client, r, max_tokens), daemon=True) for r in results]
    for t in threads:
        t.start()
    return results, threads


def wait_started(results: list[StreamResult], tokens: int = 2, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(len(r.token_ids) >= tokens or r.finish_reason or r.error_code for r in results):
            return
        time.sleep(0.05)
    raise TimeoutError("streams did not start")


def wait_speculating(results: list[StreamResult], timeout_s: float = 60.0) -> int:
    """Wait until every speculative stream has shown a step that accepted drafted tokens (a streamed message of
    several tokens, with stream_interval 1), so that a fault hits streams that really speculate (a chaos run in
    which nothing drafted would prove nothing); returns how many did before `timeout_s`."""
    speculative = [r for r in results if r.method != "ar"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(r.largest_delta > 1 or r.finish_reason for r in speculative):
        time.sleep(0.02)
    return sum(r.largest_delta > 1 and not r.finish_reason for r in speculative)


@dataclass
class References:
    """A calm run: target-only (`ar`) greedy outputs, which every speculative stream must reproduce, and each
    (prompt, method)'s τ."""
    tokens: dict[str, list[int]]
    tau: dict[tuple[str, str], float]


def greedy_references(client, prompts, max_tokens: int, methods=METHODS) -> References:
    def run(prompt, method):
        return client.generate(messages=[{"role": "user", "content": prompt}], method=method, max_tokens=max_tokens,
                               ignore_eos=True)
    tokens = {p: run(p, "ar").token_ids for p in prompts}
    return References(tokens, {(p, m): run(p, m).stats["tau"] for p in prompts for m in methods})


def speculation_back_s(client, timeout_s: float = 60.0, concurrency: int = 1) -> float:
    """Seconds until new requests speculate again: `concurrency` requests at once (one: a single stream; more:
    under load), every one with drafted trees and no step without its draft."""
    from concurrent.futures import ThreadPoolExecutor

    def speculated(prompt: str) -> bool:
        done = client.generate(prompt, method="evospec", max_tokens=8, ignore_eos=True)
        return done.stats.get("drafted", 0) > 0 and not done.stats.get("fallback_steps", 0)
    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        while time.monotonic() - start < timeout_s:
            try:
                if all(pool.map(speculated, [PROMPTS[i % len(PROMPTS)] for i in range(concurrency)])):
                    return time.monotonic() - start
            except Exception:  # noqa: BLE001 - the service may still be recovering
                pass
            time.sleep(0.25)
    return float("inf")


def stream_figures(results: list[StreamResult], references: References) -> dict:
    speculative = [r for r in results if r.method != "ar"]
    untouched = [r for r in speculative if r.finish_reason and not r.stats.get("fallback_steps", 0)]
    tau_moved = [abs(r.stats["tau"] - references.tau[r.prompt, r.method]) for r in untouched
                 if (r.prompt, r.method) in references.tau]
    return {
        "streams": len(results),
        "completed": sum(bool(r.finish_reason) for r in results),
        "greedy_identical": sum(r.token_ids == references.tokens[r.prompt] for r in results),
        "fell_back": sum(r.stats.get("fallback_steps", 0) > 0 for r in speculative),
        "resumed": sum(r.stats.get("draft_resumes", 0) > 0 for r in speculative),
        "untouched": len(untouched),
        "untouched_max_tau_change": round(max(tau_moved, default=0.0), 4),
        "longest_gap_s": round(max((r.longest_gap_s for r in results), default=0.0), 3),
        "errors": sorted({f"{r.error_code}: {r.error}" for r in results if r.error_code}),
        "per_stream": [{"prompt": PROMPTS.index(r.prompt) if r.prompt in PROMPTS else -1, "method": r.method,
                        "identical": r.token_ids == references.tokens[r.prompt],
                        "first_difference": first_difference(r.token_ids, references.tokens[r.prompt]),
                        **{k: r.stats.get(k) for k in ("tau", "fallback_steps", "draft_resumes")}}
                       for r in results],
    }


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first token where two outputs differ (-1: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


# ---- the scenarios ---------------------------------------------------------------------------------------------------
def jobs_for(streams_per_method: int) -> list[tuple[str, str]]:
    return [(PROMPTS[i % len(PROMPTS)], method) for method in METHODS for i in range(streams_per_method)]


def draft_freeze(client, app: str, references, streams_per_method: int, max_tokens: int, freeze_s: float) -> dict:
    pid = replica_pid(replica_actors(app, "Draft")[0])
    results, threads = start_streams(client, jobs_for(streams_per_method), max_tokens)
    wait_started(results)
    speculating = wait_speculating(results)
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(freeze_s)
    finally:
        os.kill(pid, signal.SIGCONT)
    back_s = speculation_back_s(client)  # from the thaw, while the streams may still run
    for t in threads:
        t.join(timeout=300)
    return {"scenario": "draft_freeze", "freeze_s": freeze_s, "speculating_before_fault": speculating,
            **stream_figures(results, references), "speculation_back_after_thaw_s": round(back_s, 2)}


def draft_kill(client, app: str, references, streams_per_method: int, max_tokens: int) -> dict:
    results, threads = start_streams(client, jobs_for(streams_per_method), max_tokens)
    wait_started(results)
    speculating = wait_speculating(results)
    before = replica_names(app, "Draft")
    killed = time.monotonic()
    kill_replica(app, "Draft")
    healthy = wait_replaced(app, "Draft", before)
    back_s = speculation_back_s(client)  # a single new stream, while the killed-over streams may still run
    for t in threads:
        t.join(timeout=300)
    back_loaded_s = speculation_back_s(client, concurrency=len(results))  # as many new streams at once
    return {"scenario": "draft_kill", "speculating_before_fault": speculating, **stream_figures(results, references),
            "draft_healthy_after_kill_s": round(healthy - killed, 2),
            "speculation_back_after_healthy_s": round(back_s, 2),
            "speculation_back_under_load_s": round(back_loaded_s, 2)}


def target_kill(client, app: str, streams: int, max_tokens: int) -> dict:
    results, threads = start_streams(client, [(PROMPTS[i % len(PROMPTS)], "evospec") for i in range(streams)],
                                     max_tokens)
    wait_started(results)
    killed = time.monotonic()
    kill_replica(app, "Target")
    for t in threads:
        t.join(timeout=300)
    return {"scenario": "target_kill", **client_side_figures(results),
            **new_calls_until_answering(client, since=killed, timeout_s=120)}


def new_calls_until_answering(client, since: float, timeout_s: float) -> dict:
    """New calls after a target failure, one after another and each without the SDK's retry: seconds from `since`
    until one succeeds (and how long that call took: held in the proxy until a replica came back, it would take
    the restart's time), and how the failing ones ended (their codes; the slowest one's seconds: a restart must
    fail them fast, so the SDK's retry applies, never hold them to their deadline)."""
    from evospec_client import EvoSpecClient
    failures: list[tuple[str, float]] = []
    health: set[str] = set()
    answered, answer_s = float("inf"), float("inf")
    with EvoSpecClient(client.address, retries=0) as probe:
        while time.monotonic() - since < timeout_s:
            health.add(health_answer(client.address, client.metadata))
            start = time.monotonic()
            try:
                probe.generate(PROMPTS[0], method="evospec", max_tokens=4, timeout=30)
                answered, answer_s = time.monotonic() - since, time.monotonic() - start
                break
            except Exception as exc:  # noqa: BLE001 - not back yet: how did it end?
                failures.append((getattr(getattr(exc, "code", None), "name", type(exc).__name__),
                                 time.monotonic() - start))
                time.sleep(0.25)
    return {"answers_again_after_s": round(answered, 2), "answering_call_s": round(answer_s, 2),
            "failed_new_calls": len(failures),
            "failed_new_call_codes": sorted({code for code, _ in failures}),
            "slowest_failed_new_call_s": round(max((s for _, s in failures), default=0.0), 2),
            "health_answers": sorted(health)}


def health_answer(address: str, metadata=(), timeout_s: float = 10.0) -> str:
    """What grpc.health.v1 Check answers now: "SERVING", "NOT_SERVING: <reason>" (the reason in the trailing
    metadata) or the error status's code name."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from evospec.services.target.ingress import HEALTH_REASON_KEY
    with grpc.insecure_channel(address) as channel:
        try:
            reply, call = health_pb2_grpc.HealthStub(channel).Check.with_call(
                health_pb2.HealthCheckRequest(), timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as err:
            return err.code().name
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    reason = dict(call.trailing_metadata() or ()).get(HEALTH_REASON_KEY)
    return f"{status}: {reason}" if reason else status


def answers_again_s(client, since: float, timeout_s: float) -> float:
    """Seconds from `since` until a short generation succeeds again (inf after `timeout_s`)."""
    while time.monotonic() - since < timeout_s:
        try:
            client.generate(PROMPTS[0], method="evospec", max_tokens=4, timeout=30)
            return time.monotonic() - since
        except Exception:  # noqa: BLE001 - not back yet
            time.sleep(0.25)
    return float("inf")


def client_side_figures(results: list[StreamResult]) -> dict:
    """What the clients of a target failure saw: completions, status codes, messages, and any internals in them."""
    messages = [f"{r.error_code}: {r.error}" for r in results if r.error_code]
    return {"streams": len(results), "completed": sum(bool(r.finish_reason) for r in results),
            "error_codes": sorted({r.error_code for r in results if r.error_code}),
            "errors": sorted(set(messages)),
            "leaking_internals": sum(any(w.lower() in m.lower() for w in INTERNALS) for m in messages)}


def stop_scheduler_thread(actor) -> None:
    """End a Target replica's scheduler thread at its next step, as a bug escaping its loop would. Reaches into the
    replica through Serve's actor internals (chaos only: if a Ray upgrade renames them, this fails loudly)."""
    import ray

    def stop(replica_actor) -> None:
        target = replica_actor._replica_impl._user_callable_wrapper._callable  # our TargetDeployment
        scheduler = target.server.scheduler

        def dead_step() -> None:
            raise SystemExit("scheduler thread stopped by evospec chaos")
        scheduler.step = dead_step
        scheduler.waiting.notify()
    ray.get(actor.__ray_call__.remote(stop), timeout=30)


def target_engine_death(client, app: str, streams: int, max_tokens: int) -> dict:
    """The Target replica's scheduler thread dies while streams run: they end with UNAVAILABLE "target restarting,
    retry", the replica's health predicate fails, Serve replaces it, and the service answers again."""
    results, threads = start_streams(client, [(PROMPTS[i % len(PROMPTS)], "evospec") for i in range(streams)],
                                     max_tokens)
    wait_started(results)
    before = replica_names(app, "Target")
    died = time.monotonic()
    stop_scheduler_thread(replica_actors(app, "Target")[0])
    for t in threads:
        t.join(timeout=300)
    replaced = wait_replaced(app, "Target", before)
    return {"scenario": "target_engine_death", **client_side_figures(results),
            "replaced_after_s": round(replaced - died, 2),
            "answers_again_after_s": round(answers_again_s(client, since=died, timeout_s=300), 2)}


def run_all(address: str, app: str, streams_per_method: int, max_tokens: int, freeze_s: float) -> list[dict]:
    from evospec_client import EvoSpecClient
    with EvoSpecClient(address, timeout=300, app_name=app) as client:
        client.wait_ready(timeout=300)
        references = greedy_references(client, PROMPTS[:streams_per_method], max_tokens)
        return [draft_freeze(client, app, references, streams_per_method, max_tokens, freeze_s),
                draft_kill(client, app, references, streams_per_method, max_tokens),
                target_kill(client, app, 2 * streams_per_method, max_tokens),
                target_engine_death(client, app, 2 * streams_per_method, max_tokens)]


def for_chaos(cfg, draft_replicas: int = 1, target_replicas: int = 1):
    """`cfg` with every request drafting its full tree (τ comparable across runs) and the given replica counts."""
    def scaled(service, n: int, **update):
        return service.model_copy(update={"replica": service.replica.model_copy(update={"num_replicas": n}),
                                          **update})
    scheduler = cfg.target.scheduler.model_copy(update={"adaptive": False})
    return cfg.model_copy(update={"target": scaled(cfg.target, target_replicas, scheduler=scheduler),
                                  "draft": scaled(cfg.draft, draft_replicas)})


def in_float32(cfg):
    def f32(service):
        return service.model_copy(update={"model": service.model.model_copy(update={"dtype": "float32"})})
    return cfg.model_copy(update={"draft": f32(cfg.draft), "target": f32(cfg.target)})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evospec chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="app YAML (default: cpu-tiny.yaml)")
    ap.add_argument("--streams", type=int, default=4, help="concurrent streams per speculative method")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--freeze-s", type=float, default=5.0, help="how long the draft process stays frozen")
    ap.add_argument("--draft-replicas", type=int, default=1, help="Draft replicas (a kill then hits one of them)")
    ap.add_argument("--target-replicas", type=int, default=1, help="Target replicas (Serve spreads the streams)")
    ap.add_argument("--float32", action="store_true",
                    help="both models in float32, so greedy outputs are comparable token for token across batch "
                         "compositions (in bf16 a near-tie can break either way when the batch changes)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    from evospec.orchestration.config import DEFAULT_CONFIG, AppConfig
    from evospec.orchestration.local import TWO_NODES, free_port, local_ray, placed_on_nodes, serve_app
    cfg = for_chaos(placed_on_nodes(AppConfig.from_yaml(args.config or DEFAULT_CONFIG)), args.draft_replicas,
                    args.target_replicas)
    cfg = cfg.model_copy(update={"grpc_port": free_port(), "http_port": free_port()})
    if args.float32:
        cfg = in_float32(cfg)
    with local_ray(num_cpus=4, nodes=TWO_NODES), serve_app(cfg) as address:
        figures = run_all(address, cfg.app_name, args.streams, args.max_tokens, args.freeze_s)
    for row in figures:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


