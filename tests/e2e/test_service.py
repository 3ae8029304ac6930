"""End to end on a real local Ray Serve: the decoupled draft/target service through the SDK."""
import threading
import time

import grpc
import pytest

from evospec.config import SamplingParams, SpecParams
from evospec.tokenizer import chat_prompt_ids
from evospec_client import InvalidArgument

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

QUESTION = "Is a high body mass index associated with worse outcomes after surgery for colorectal cancer?"
MESSAGES = [{"role": "user", "content": QUESTION}]


def reference(in_process, max_tokens, messages=MESSAGES):
    prompt = chat_prompt_ids(in_process.tokenizer, messages)
    gen = in_process.decoder.generate(list(prompt), SamplingParams(max_tokens=max_tokens), SpecParams(method="ar"))
    list(gen)
    return gen.output_ids


@pytest.mark.parametrize("method,tree", [("ar", {}), ("sd", {"shape": "chain", "num_draft_tokens": 4}),
                                         ("frspec", {"shape": "tree", "depth": 3, "branching": 2, "budget": 6}),
                                         ("evospec", {"shape": "chain", "num_draft_tokens": 4})])
def test_greedy_through_service_equals_in_process_ar(client, in_process, method, tree):
    expected = reference(in_process, 48)
    out = client.generate(messages=MESSAGES, max_tokens=48, method=method, tree=tree)
    assert out.token_ids == expected
    assert out.finish_reason in ("stop", "length")
    stats = out.stats
    assert stats["method"] == method and stats["generated_tokens"] == len(expected)
    if method != "ar":
        assert stats["steps"] < len(expected)  # speculation accepted something
        assert stats["tau"] > 1.0


@pytest.mark.parametrize("method", ["frspec", "evospec"])
def test_decoupled_stats_equal_in_process_stats(client, in_process, method):
    """Same greedy run in process and through the service: identical steps, acceptance, misses, buffer updates
    (the remote protocol carries the same information as the local loop)."""
    prompt = chat_prompt_ids(in_process.tokenizer, MESSAGES)
    spec = SpecParams(method=method, vocab={"static_size": 8192, "dynamic_size": 256})
    gen = in_process.decoder.generate(prompt, SamplingParams(max_tokens=40), spec)
    list(gen)
    out = client.generate(messages=MESSAGES, max_tokens=40, method=method, static_size=8192, dynamic_size=256)
    local = gen.stats.as_dict()
    for key in ("steps", "drafted", "accepted", "accepted_per_pos", "misses", "verified_positions", "buffer_updates",
                "buffer_hits_statistical", "buffer_hits_semantic", "buffer_hits_target"):
        assert out.stats.get(key, 0 if key != "accepted_per_pos" else []) == local[key], key
    assert set(out.stats) >= set(local)  # every statistic the engine measures reaches the client
    assert out.stats["draft_head_seconds"] > 0 and out.stats["buffer_update_seconds"] > 0


@pytest.mark.parametrize("method", ["sd", "evospec"])
def test_seeded_sampling_through_service_equals_in_process(client, in_process, method):
    """Same seed, same sampled tokens: the remote draft uses the same RNG streams and the same A as the local one."""
    prompt = chat_prompt_ids(in_process.tokenizer, MESSAGES)
    sampling = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=11)
    gen = in_process.decoder.generate(prompt, sampling, SpecParams(method=method))
    list(gen)
    out = client.generate(messages=MESSAGES, max_tokens=40, temperature=0.8, top_p=0.95, seed=11, method=method)
    assert out.token_ids == gen.output_ids
    assert out.stats["accepted"] == gen.stats.accepted and out.stats["steps"] == gen.stats.steps


def test_streaming_deltas_and_unary(client, in_process):
    expected = reference(in_process, 24)
    deltas = list(client.stream(messages=MESSAGES, max_tokens=24, method="evospec"))
    assert sum((d.token_ids for d in deltas), []) == expected
    assert deltas[-1].stats and all(not d.stats for d in deltas[:-1])
    once = client.generate_once(messages=MESSAGES, max_tokens=24, method="sd")
    assert once.token_ids == expected and once.text == in_process.tokenizer.decode(expected)


def test_concurrent_streams(client, in_process):
    questions = ["Does smoking affect wound healing after surgery?", "Is vitamin D deficiency linked to falls?",
                 "Do statins reduce mortality in sepsis?", "Is obesity a risk factor for asthma in children?"]
    expected = [reference(in_process, 32, [{"role": "user", "content": q}]) for q in questions]
    results, errors = [None] * len(questions), []

    def run(i):
        try:
            results[i] = client.generate(messages=[{"role": "user", "content": questions[i]}], max_tokens=32,
                                         method=["sd", "evospec", "frspec", "ar"][i]).token_ids
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(questions))]
    [t.start() for t in threads]
    [t.join(timeout=300) for t in threads]
    assert not errors and results == expected


def sessions():
    from ray import serve
    return serve.get_app_handle("evospec").num_sessions.remote().result(timeout_s=30)


def test_cancellation_frees_both_sides(client):
    stream = client.stream(messages=MESSAGES, max_tokens=400, ignore_eos=True, method="evospec")
    next(stream)
    next(stream)
    assert sessions() == {"target": 1, "draft": 1}
    stream.close()  # cancels the RPC
    deadline = time.monotonic() + 30
    while sessions() != {"target": 0, "draft": 0} and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sessions() == {"target": 0, "draft": 0}


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"method": "medusa"}, "method"),
    ({"tree": {"shape": "tree", "budget": 0}}, "budget"),
    ({"static_size": 10**6}, "static_size"),
    ({"max_tokens": 100000}, "max_tokens"),
])
def test_bad_requests_are_invalid_argument(client, kwargs, field):
    with pytest.raises(InvalidArgument) as e:
        client.generate(messages=MESSAGES, **kwargs)
    assert field in e.value.details


def test_empty_and_out_of_range_prompts(client):
    with pytest.raises(InvalidArgument, match="prompt"):
        client.generate(prompt="")
    with pytest.raises(InvalidArgument, match="prompt_token_ids"):
        client.generate(prompt_token_ids=[1, 10**7])
    with pytest.raises(InvalidArgument, match="role"):
        client.generate(messages=[{"role": "robot", "content": "hi"}])


def test_info_and_health(client, service):
    info = client.info()
    assert info["default_method"] == "evospec" and "evospec" in info["methods"]
    assert info["static_vocab_size"] == 32768
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(service[0]) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10,
                                                          metadata=(("application", "evospec"),))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
