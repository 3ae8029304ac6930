"""The OpenAI-compatible front in process: the official `openai` client (over an in-memory ASGI transport) against
the tiny pair's target server with a real draft server, raw HTTP for the error cases, and /metrics.

The same routes through Serve's HTTP proxy are tested in tests/e2e/test_openai_e2e.py."""
from __future__ import annotations

import asyncio
import json

import httpx2
import openai
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from evospec.config import SamplingParams, SchedulerConfig
from evospec.errors import InvalidRequestError
from evospec.orchestration.fuzz import HTTP_INVALID, HTTP_NOT_FOUND, HTTP_RAW, HTTP_ROUTES, HTTP_VALID, names_param
from evospec.services.common.metrics import HttpMetrics
from evospec.services.config import TargetServiceConfig
from evospec.services.target.grpc_api import GrpcFront
from evospec.services.target.openai_api import OpenAIFront, build_http_app
from evospec.services.target.server import DraftSide, GenerateRequest, Prompt, TargetServer
from evospec.services.target.textstream import TextStream
from evospec.testing import prometheus_values
from evospec.tokenizer import load_tokenizer

MODEL = "tiny-target"
GREEDY = {"temperature": 0, "max_tokens": 24}
PROMPT = "Does aspirin reduce the risk of myocardial infarction?"


@pytest.fixture(scope="module")
def stack(tiny_draft_replica):
    _, _, pool = tiny_draft_replica

    async def name():
        return "tiny"

    async def adapt_stats():
        return {"mode": "lora", "version": 3}
    cfg = TargetServiceConfig(scheduler=SchedulerConfig(adaptive=False),
                              public={"served_model_name": MODEL, "auth_tokens": ["tok-123"],
                                      "default_max_tokens": 4})  # the fuzz test's valid bodies stay short
    server = TargetServer.from_config(cfg, DraftSide(pool, name, name, adapt_stats))
    metrics = HttpMetrics(MODEL)
    server.metrics = (metrics.service,)
    front = OpenAIFront(server, cfg.public, MODEL, metrics)
    yield build_http_app(front), server
    server.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


def client(app, key="tok-123") -> openai.AsyncOpenAI:
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key=key, http_client=http, max_retries=0)


async def raw(app, method: str, path: str, body=None, key: str | None = "tok-123", content: bytes | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if body is not None:  # json.dumps escapes what UTF-8 cannot encode (a lone surrogate), as a client's JSON would
        content, headers = json.dumps(body).encode(), {**headers, "content-type": "application/json"}
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://test") as http:
        return await http.request(method, path, content=content, headers=headers)


def grpc_text(server: TargetServer, prompt: Prompt, max_tokens: int, stop: list[str] | None = None,
              ignore_eos: bool = False) -> str:
    """The same greedy request through the gRPC front (its streamed text, joined)."""
    from evospec_client.api.v1 import generate_pb2 as pb
    if prompt.messages is not None:
        req = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role=m.role, content=m.content)
                                                        for m in prompt.messages]))
    else:
        req = pb.GenerateRequest(prompt=prompt.text)
    req.sampling.max_tokens, req.sampling.temperature, req.sampling.ignore_eos = max_tokens, 0.0, ignore_eos
    req.sampling.stop.extend(stop or [])

    class Context:  # what the gRPC front reads from Serve's request context
        def invocation_metadata(self):
            return (("authorization", "Bearer tok-123"),)

    async def collect():
        return "".join([r.text async for r in GrpcFront(server).Generate(req, Context())])
    return run(collect())


def test_chat_streaming_and_not_equal_grpc_greedy_text(stack):
    app, server = stack
    messages = [{"role": "user", "content": PROMPT}]

    async def both():
        c = client(app)
        whole = await c.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
        stream = await c.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY)
        chunks = [chunk async for chunk in stream]
        return whole, chunks
    whole, chunks = run(both())
    text = whole.choices[0].message.content
    assert text and whole.choices[0].finish_reason in ("stop", "length")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert text == grpc_text(server, Prompt(messages=[_msg(PROMPT)]), GREEDY["max_tokens"])
    spec = whole.usage.model_extra["speculation"]
    assert spec["method"] == "evospec" and spec["steps"] > 0 and spec["tau"] >= 1
    assert whole.usage.prompt_tokens == spec["prompt_tokens"] and whole.usage.completion_tokens == spec[
        "generated_tokens"]


def _msg(content):
    from evospec.services.target.server import ChatMessage
    return ChatMessage("user", content)


@pytest.mark.parametrize("method", ["ar", "frspec", "evospec"])
def test_completions_streaming_and_not_with_speculation_options(stack, method):
    app, server = stack
    extra = {"speculation": {"method": method, "dynamic_size": 64}}

    async def both():
        c = client(app)
        whole = await c.completions.create(model=MODEL, prompt=PROMPT, extra_body=extra, **GREEDY)
        stream = await c.completions.create(model=MODEL, prompt=PROMPT, stream=True, extra_body=extra, **GREEDY)
        return whole, [chunk async for chunk in stream]
    whole, chunks = run(both())
    assert whole.object == "text_completion" and whole.usage.model_extra["speculation"]["method"] == method
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert whole.choices[0].text == grpc_text(server, Prompt(text=PROMPT), GREEDY["max_tokens"])


def test_stop_string_ends_the_text_before_it_through_both_fronts(stack):
    app, server = stack

    async def go(stop):
        c = client(app)
        r = await c.completions.create(model=MODEL, prompt=PROMPT, stop=stop, extra_body={"ignore_eos": True},
                                       **GREEDY)
        assert r.usage.model_extra["speculation"]["generated_tokens"] == r.usage.completion_tokens
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
    full, _, n_full = run(go(None))
    assert len(full) > 6
    stop = full[3:6]
    text, reason, n = run(go([stop, "never-appears"]))
    assert reason == "stop" and text == full[:full.index(stop)] and n < n_full
    through_grpc = grpc_text(server, Prompt(text=PROMPT), GREEDY["max_tokens"], [stop, "never-appears"], ignore_eos=True)
    assert through_grpc == text


def test_text_stream_holds_split_characters_and_stop_prefixes():
    tok = load_tokenizer()
    ids = tok("a µg dose 你好 then END here", add_special_tokens=False)["input_ids"]
    plain = TextStream(tok)
    pieces = [plain.feed([i]).text for i in ids] + [plain.finish()]
    assert "".join(pieces) == tok.decode(ids) and "\ufffd" not in "".join(pieces)
    stopped = TextStream(tok, ("END",))
    out, used = [], 0
    for i in ids:
        delta = stopped.feed([i])
        out.append(delta.text)
        used += len(delta.token_ids)
        assert "E" not in "".join(out)  # text that may begin the stop string is held back
        if delta.stopped:
            break
    out.append(stopped.finish())
    assert "".join(out) == "a µg dose 你好 then " and used < len(ids)


@pytest.mark.parametrize("body, status, param", [
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, 400, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 9}, 400, "max_tokens"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "ok"}, {"role": "robot", "content": "hi"}]}, 400, "messages[1].role"),
    ({"messages": [{"role": ["user"], "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": ["hi"]}, 400, "messages[0]"),
    ({"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b\udfff"]}, 400, "stop[1]"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "4"}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": True}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4.0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "0"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "speculation": {"predraft": "yes"}}, 400,
     "speculation.predraft"),
    ({"messages": [{"role": "user", "content": "hi"}], "speculation": {"depth": 2 ** 32}}, 400, "speculation.depth"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_k": 2 ** 64}, 400, "top_k"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_k": -2}, 400, "top_k"),
    ({"messages": [{"role": "user", "content": "hi"}], "seed": -5}, 400, "seed"),
    ({"messages": [{"role": "user", "content": "hi"}], "seed": 2 ** 64}, 400, "seed"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a", 1]}, 400, "stop[1]"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": 1}}, 400,
     "stream_options.include_usage"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}, 400, "tool_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi"}], "speculation": {"method": "eagle"}}, 400,
     "speculation.method"),
    ({"messages": [{"role": "user", "content": "hi"}], "speculation": {"dynamic_size": 10 ** 6}}, 400,
     "speculation.dynamic_size"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": [""]}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404, "model"),
    ({"messages": []}, 400, "messages"),
    ({}, 400, "messages"),
])
def test_bad_requests_get_openai_errors_naming_the_field(stack, body, status, param):
    app, _ = stack
    r = run(raw(app, "POST", "/v1/chat/completions", body))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


def test_not_json_unknown_route_and_missing_key(stack):
    app, _ = stack
    r = run(raw(app, "POST", "/v1/completions", content=b"{not json"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = run(raw(app, "GET", "/v1/embeddings"))
    assert r.status_code == 404 and "/v1/chat/completions" in r.json()["error"]["message"]
    r = run(raw(app, "POST", "/v1/completions", {"prompt": "hi"}, key=None))
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = run(raw(app, "GET", "/v1/models", key="wrong"))
    assert r.status_code == 401
    assert run(raw(app, "GET", "/health", key=None)).status_code == 200  # open, for load balancers
    models = run(raw(app, "GET", "/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


@pytest.mark.parametrize("content_type, status", [("text/plain", 415), ("application/x-www-form-urlencoded", 415),
                                                  ("multipart/form-data; boundary=x", 415), ("", 415),
                                                  ("application/json; charset=utf-8", 200),
                                                  ("application/vnd.api+json", 200), (None, 200)])
def test_only_json_bodies_are_read_as_json(stack, content_type, status):
    """A JSON body declared as text (or a form) is refused with 415 naming Content-Type, not guessed at; no header at
    all is read as JSON (as FastAPI and vLLM do)."""
    app, _ = stack
    headers = {"Authorization": "Bearer tok-123"} | ({} if content_type is None else {"content-type": content_type})

    async def post():
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://test") as http:
            return await http.post("/v1/completions", content=json.dumps(BASE_BODIES["/v1/completions"]).encode(),
                                   headers=headers)
    r = run(post())
    assert r.status_code == status, r.text
    if status == 415:
        assert r.json()["error"]["param"] == "Content-Type"


def test_overloaded_is_429_with_retry_after(stack, monkeypatch):
    app, server = stack
    from evospec.errors import OverloadedError

    def full(*args, **kwargs):
        raise OverloadedError("256 requests already wait for KV memory; retry later")
    monkeypatch.setattr(server.scheduler, "submit", full)
    r = run(raw(app, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}))
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_exceeded"


def scrape(app) -> dict[str, float]:
    return prometheus_values(run(raw(app, "GET", "/metrics", key=None)).text)


def test_metrics_move_by_the_request_statistics_and_show_it_running(stack):
    app, server = stack

    async def scrape_mid_generation():
        request = GenerateRequest(Prompt(text=PROMPT), SamplingParams(max_tokens=8, ignore_eos=True),
                                  server.default_spec)
        events = server.generate(request)
        await anext(events)
        try:
            return await asyncio.to_thread(scrape, app)
        finally:
            await events.aclose()
    assert run(scrape_mid_generation())["vllm:num_requests_running"] == 1
    before = scrape(app)

    async def generate():
        c = client(app)
        stream = await c.completions.create(model=MODEL, prompt=PROMPT, stream=True, stream_options={
            "include_usage": True}, extra_body={"speculation": {"method": "evospec"}, "ignore_eos": True}, **GREEDY)
        return [chunk async for chunk in stream]
    chunks = run(generate())
    after = scrape(app)
    stats = chunks[-1].usage.model_extra["speculation"]

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)
    m = "|method=evospec"
    assert delta(f"vllm:spec_decode_num_drafts_total{m}") == stats["steps"] > 0
    assert delta(f"vllm:spec_decode_num_draft_tokens_total{m}") == stats["drafted"]
    assert delta(f"vllm:spec_decode_num_accepted_tokens_total{m}") == stats["accepted"]
    per_pos = sum(delta(f"vllm:spec_decode_num_accepted_tokens_per_pos_total{m}|position={p}")
                  for p in range(len(stats["accepted_per_pos"])))
    assert per_pos == sum(stats["accepted_per_pos"])
    assert delta(f"vllm:generation_tokens_total{m}") == stats["generated_tokens"]
    assert delta(f"vllm:prompt_tokens_total{m}") == stats["prompt_tokens"]
    assert delta(f"vllm:time_to_first_token_seconds_count{m}") == 1
    assert delta(f"vllm:e2e_request_latency_seconds_count{m}") == 1
    assert delta(f"vllm:inter_token_latency_seconds_count{m}") == sum(1 for c in chunks if c.choices) - 2
    assert delta(f"evospec:draft_vocab_misses_total{m}") == stats["misses"]
    reason = chunks[-2].choices[0].finish_reason
    assert delta(f"vllm:request_success_total|finished_reason={reason}{m}") == 1
    assert after["evospec:adapter_version|mode=lora"] == 3
    assert after["vllm:num_requests_running"] == 0


def test_generate_request_stop_is_validated(stack):
    _, server = stack

    async def go():
        request = GenerateRequest(Prompt(text="hi"), SamplingParams(max_tokens=2), server.default_spec,
                                  stop=("x" * 300,))
        return [event async for event in server.generate(request)]
    with pytest.raises(InvalidRequestError, match="stop"):
        run(go())


@pytest.mark.parametrize("body, param", [
    ({"prompt": [10 ** 9]}, "prompt"),
    ({"prompt": ["one", "two"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "hi", "logprobs": 2}, "logprobs"),
    ({"prompt": "hi", "echo": True}, "echo"),
    ({"prompt": "hi", "stop": ["x"] * 17}, "stop"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": {"nested": None}}, "prompt"),
    ({"prompt": "hi", "tools": [{"type": "function"}]}, "tools"),
    ({"prompt": "hi", "top_logprobs": 2}, "top_logprobs"),
    ({"prompt": "hi", "response_format": {"type": "json_object"}}, "response_format"),
    ({"prompt": [1, -1]}, "prompt"),
    ({"prompt": [1, 2 ** 32]}, "prompt"),
    ({"prompt": "\udc00"}, "prompt"),
    ({"prompt": "hi", "max_tokens": "4"}, "max_tokens"),
    ({"prompt": "hi", "echo": 1}, "echo"),
])
def test_bad_completions_get_400_naming_the_parameter(stack, body, param):
    app, _ = stack
    r = run(raw(app, "POST", "/v1/completions", body))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param)


BASE_BODIES = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
               "/v1/completions": {"prompt": "hi", "max_tokens": 2}}


def every_entry(catalogue: dict[str, list]) -> list[tuple]:
    """(parameter, value) for every value of every parameter of a fuzz catalogue."""
    return [(param, value) for param, values in catalogue.items() for value in values]


@pytest.mark.parametrize("route", sorted(HTTP_ROUTES))
@pytest.mark.parametrize("param, value", every_entry(HTTP_INVALID), ids=lambda x: repr(x)[:24])
def test_every_invalid_parameter_is_a_4xx_naming_it_on_both_routes(stack, route, param, value):
    """The fuzz catalogue (orchestration/fuzz.py HTTP_INVALID), every entry on both routes."""
    app, _ = stack
    r = run(raw(app, "POST", route, {**BASE_BODIES[route], param: value}))
    assert r.status_code == (404 if (param, value) in HTTP_NOT_FOUND else 400), r.text
    assert names_param(r.json()["error"]["param"], param), r.text


@pytest.mark.parametrize("route", sorted(HTTP_ROUTES))
@pytest.mark.parametrize("param, value", every_entry(HTTP_VALID), ids=lambda x: repr(x)[:24])
def test_valid_edges_are_served_on_both_routes(stack, route, param, value):
    app, _ = stack
    r = run(raw(app, "POST", route, {**BASE_BODIES[route], param: value}))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("name", sorted(HTTP_RAW))
def test_bodies_that_are_not_json_objects_of_text_name_the_body(stack, name):
    app, _ = stack
    r = run(raw(app, "POST", "/v1/completions", content=HTTP_RAW[name]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "body", r.text


SMALL = st.integers(-3, 6) | st.sampled_from([0, 2 ** 32 - 1, 2 ** 32, 2 ** 63, 10 ** 12, 2 ** 64])
SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\udbff\udbff"])
TEXT = st.text(max_size=12) | SURROGATES
JSON = st.recursive(st.none() | st.booleans() | SMALL | st.floats(allow_nan=True, allow_infinity=True)
                    | TEXT, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
# Well-formed values (so that many cases reach a generation) or the edge of their range, plus one field replaced
# by any JSON at all.
TOKENS = st.integers(1, 6) | st.sampled_from([0, 10 ** 12])
FIELDS = {"model": st.sampled_from([MODEL, MODEL, "gpt-4"]), "max_tokens": TOKENS, "max_completion_tokens": TOKENS,
          "temperature": st.floats(0, 2) | st.just(-1.0), "top_p": st.floats(0.01, 1) | st.just(1.5),
          "seed": st.integers(0, 2 ** 64) | st.just(-1), "stream": st.booleans(),
          "stop": st.text(max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3) | st.just([""] * 17),
          "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "n": st.sampled_from([1, 1, 2]),
          "logprobs": st.sampled_from([False, None, True]), "ignore_eos": st.booleans(), "unknown_field": JSON,
          "speculation": st.fixed_dictionaries({}, optional={
              "method": st.sampled_from(["ar", "sd", "frspec", "evospec", "lookup", "x"]), "dynamic_size": st.integers(0, 5000),
              "depth": st.integers(0, 6), "shape": st.sampled_from(["chain", "tree"])})}
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "user", "system", "assistant", "tool"]),
                                           "content": st.text(max_size=30) | SURROGATES}), max_size=3)
PROMPTS = st.text(max_size=30) | st.lists(st.integers(-1, 200), max_size=5)
GARBAGE = st.none() | st.tuples(st.sampled_from([*FIELDS, "messages", "prompt"]), JSON)


@pytest.mark.fuzz
@given(route=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
       body=st.fixed_dictionaries({}, optional=FIELDS), messages=MESSAGES, prompt=PROMPTS, garbage=GARBAGE)
def test_any_json_body_is_served_or_refused_with_openai_json_never_a_500(stack, route, body, messages, prompt,
                                                                         garbage):
    """Property: whatever JSON a client sends, the answer is a completion (200) or an OpenAI error naming what to
    fix (400, or 404 for a model this server does not serve); never a 500, a hang or a non-JSON error."""
    app, _ = stack
    chat = route.endswith("chat/completions")
    body = {**body, **({"messages": messages} if chat else {"prompt": prompt}), **dict([garbage] if garbage else [])}
    r = run(raw(app, "POST", route, content=json.dumps(body).encode()))  # NaN/Infinity as Python writes them
    event(f"HTTP {r.status_code}")  # --hypothesis-show-statistics: how many cases reached a generation
    assert r.status_code in (200, 400, 404), (r.status_code, r.text, body)
    if r.status_code != 200:
        error = r.json()["error"]
        assert error["message"] and (error["param"] or r.status_code == 404), body
    elif not body.get("stream"):
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
