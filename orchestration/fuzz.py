"""`evospec fuzz`: random valid and invalid requests against a running service, over the raw public API.

Every case is a valid base request with mutations from one catalogue (`VALID` keeps it valid, `INVALID` breaks one
named field), or raw bytes the proxy must not choke on. A case passes when a valid request completes (OK, at most
max_tokens tokens, a finish reason) and an invalid one gets INVALID_ARGUMENT whose message names the field. Anything
else is a failure: another status (INTERNAL, UNKNOWN...), a crash, or a hang (the per-call deadline). The same
catalogue drives the property-based test in CI (tests/unit/test_hardening.py, with hypothesis).

    evospec fuzz --cases 1000                              # starts a local service (cpu-tiny.yaml)
    evospec fuzz --address 127.0.0.1:9000 --cases 1000     # a running service
    evospec fuzz --api openai --cases 1000                 # the OpenAI routes (a local service)
    evospec fuzz --api openai --address http://127.0.0.1:8000 --cases 1000
"""
from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from evospec.orchestration.local import http_service_to_drive, service_to_drive
from evospec_client.api.v1 import generate_pb2 as pb
from evospec_client.enums import enum_string

SEED_MAX = 2**64 - 1


@dataclass(frozen=True)
class Limits:
    """What makes a request valid on this service (from its Info)."""
    max_model_len: int
    static_vocab_size: int
    max_prompt_bytes: int  # text longer than this is refused before tokenization (PublicApiConfig)
    max_tokens: int = 6  # valid cases stay short: the point is the request handling, not generation


@dataclass
class Case:
    name: str
    request: pb.GenerateRequest | bytes  # bytes: sent as is (what a client library would not produce)
    field: str | None  # None = valid; else the field INVALID_ARGUMENT must name


Mutation = Callable[[pb.GenerateRequest, random.Random, Limits], None]


def base_request(rng: random.Random, limits: Limits) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=f"fuzz-{rng.getrandbits(32):08x}")
    req.sampling.max_tokens = rng.randint(1, limits.max_tokens)
    kind = rng.choice(["prompt", "ids", "chat"])
    if kind == "prompt":
        req.prompt = rng.choice(["Is aspirin useful after a stroke?", "def f(x):\n    return", "Ünïcödé ✓ 😀 测试",
                                 "a" * rng.randint(1, 300), "\t\n "])
    elif kind == "ids":
        req.prompt_token_ids.ids.extend(rng.randrange(0, 1000) for _ in range(rng.randint(1, 40)))
    else:
        roles = ["system", "user", "assistant"]
        req.chat.messages.extend(pb.ChatMessage(role=rng.choice(roles), content=rng.choice(["hi", "", "Doses? 😀"]))
                                 for _ in range(rng.randint(1, 4)))
        req.chat.enable_thinking = rng.random() < 0.5
    return req


def _method(req, rng, limits):
    """The enum, or its string form (what clients built before the enum send), or neither (the server's default)."""
    method = rng.choice(["", "ar", "sd", "frspec", "evospec", "lookup"])
    req.spec.ClearField("method")
    req.spec.ClearField("method_name")
    if method and rng.random() < 0.5:
        req.spec.method_name = method
    elif method:
        req.spec.method = pb.Method.Value(f"METHOD_{method.upper()}")


def _sampling(req, rng, limits):
    s = req.sampling
    s.temperature = rng.choice([0.0, 1e-3, 0.5, 1.0, 2.0, 100.0])
    s.top_p = rng.choice([1e-6, 0.5, 0.9, 1.0])
    s.top_k = rng.choice([0, 1, 5, 50, 2**32 - 1])
    s.seed = rng.choice([0, 1, rng.getrandbits(64), SEED_MAX])
    s.ignore_eos = rng.random() < 0.5


def _tree(req, rng, limits):
    t = req.spec.tree
    if rng.random() < 0.5:
        t.shape = pb.TREE_SHAPE_CHAIN
        t.num_draft_tokens = rng.randint(1, 64)
    else:
        t.shape_name = "tree"  # the string form, as a client built before the enum sends it
        t.depth, t.branching, t.budget = rng.randint(1, 16), rng.randint(1, 16), rng.randint(1, 256)


def _vocab(req, rng, limits):
    req.spec.method = rng.choice([pb.METHOD_FRSPEC, pb.METHOD_EVOSPEC])
    req.spec.ClearField("method_name")
    req.spec.static_size = rng.randint(1, limits.static_vocab_size)
    req.spec.dynamic_size = rng.choice([0, 1, 256, 1024, 4096])
    req.spec.retrieval.extend(rng.sample(["statistical", "semantic", "target", "target"], rng.randint(0, 4)))


def _long_prompt(req, rng, limits):
    """A prompt of up to 2,000 ids (near the context on small models; a CPU prefill of more takes minutes)."""
    n = min(limits.max_model_len - limits.max_tokens - 300, 2000)
    req.ClearField("input")
    req.prompt_token_ids.SetInParent()
    req.prompt_token_ids.ids.extend(rng.randrange(0, 1000) for _ in range(n))


VALID: dict[str, Mutation] = {"method": _method, "sampling": _sampling, "tree": _tree, "vocab": _vocab,
                              "long_prompt": _long_prompt}


def _set(path: str, value) -> Mutation:
    """A mutation that sets one (dotted) field of the request."""
    def mutate(req, rng, limits):
        *parents, name = path.split(".")
        msg = req
        for p in parents:
            msg = getattr(msg, p)
        setattr(msg, name, value(rng, limits) if callable(value) else value)
    return mutate


def _ids(ids_of: Callable[[random.Random, Limits], list[int]]) -> Mutation:
    def mutate(req, rng, limits):
        req.ClearField("input")
        req.prompt_token_ids.SetInParent()
        req.prompt_token_ids.ids.extend(ids_of(rng, limits))
    return mutate


def _text(text_of: Callable[[random.Random, Limits], str]) -> Mutation:
    def mutate(req, rng, limits):
        req.prompt = text_of(rng, limits)
    return mutate


def _chat(*messages: tuple[str, str]) -> Mutation:
    def mutate(req, rng, limits):
        req.ClearField("input")
        req.chat.SetInParent()
        req.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in messages)
    return mutate


def _drafting(mutate: Mutation) -> Mutation:
    """`mutate` on a request whose method uses the vocabulary sizes (`ar` and `sd` ignore static_size)."""
    def both(req, rng, limits):
        req.spec.method = rng.choice([pb.METHOD_FRSPEC, pb.METHOD_EVOSPEC])
        req.spec.ClearField("method_name")
        mutate(req, rng, limits)
    return both


# name -> (mutation, the field the error must name)
INVALID: dict[str, tuple[Mutation, str]] = {
    "max_tokens_zero": (_set("sampling.max_tokens", 0), "max_tokens"),
    "max_tokens_over_context": (_set("sampling.max_tokens", lambda r, lim: lim.max_model_len + r.randint(0, 10**6)),
                                "max_tokens"),
    "temperature_negative": (_set("sampling.temperature", -0.5), "temperature"),
    "temperature_nan": (_set("sampling.temperature", float("nan")), "temperature"),
    "temperature_inf": (_set("sampling.temperature", float("inf")), "temperature"),
    "temperature_tiny": (_set("sampling.temperature", 1e-39), "temperature"),
    "temperature_huge": (_set("sampling.temperature", 1e30), "temperature"),
    "top_p_zero": (_set("sampling.top_p", 0.0), "top_p"),
    "top_p_over_one": (_set("sampling.top_p", 1.5), "top_p"),
    "top_p_nan": (_set("sampling.top_p", float("nan")), "top_p"),
    "method_unknown": (_set("spec.method_name", "medusa"), "method"),
    "method_enum_unknown": (_set("spec.method", 99), "method"),
    "method_forms_disagree": (lambda req, r, lim: (setattr(req.spec, "method", pb.METHOD_SD),
                                                   setattr(req.spec, "method_name", "frspec")), "method"),
    "shape_unknown": (_set("spec.tree.shape_name", "star"), "shape"),
    "shape_enum_unknown": (_set("spec.tree.shape", 7), "shape"),
    "num_draft_tokens_zero": (_set("spec.tree.num_draft_tokens", 0), "num_draft_tokens"),
    "num_draft_tokens_huge": (_set("spec.tree.num_draft_tokens", 2**32 - 1), "num_draft_tokens"),
    "depth_zero": (_set("spec.tree.depth", 0), "depth"),
    "depth_huge": (_set("spec.tree.depth", 17), "depth"),
    "branching_huge": (_set("spec.tree.branching", 10**6), "branching"),
    "budget_zero": (_set("spec.tree.budget", 0), "budget"),
    "budget_huge": (_set("spec.tree.budget", 257), "budget"),
    "static_size_zero": (_set("spec.static_size", 0), "static_size"),
    "static_size_over_vocab": (_drafting(_set("spec.static_size",
                                              lambda r, lim: lim.static_vocab_size + r.randint(1, 10**6))),
                               "static_size"),
    "dynamic_size_huge": (_set("spec.dynamic_size", 10**6), "dynamic_size"),
    "retrieval_unknown": (lambda req, r, lim: req.spec.retrieval.append("magic"), "retrieval"),
    "no_input": (lambda req, r, lim: req.ClearField("input"), "input"),
    "prompt_empty": (_text(lambda r, lim: ""), "prompt"),
    "prompt_over_bytes": (_text(lambda r, lim: "x" * (lim.max_prompt_bytes + 1)), "prompt"),
    "prompt_over_context": (_ids(lambda r, lim: [5] * lim.max_model_len), "prompt"),
    "ids_empty": (_ids(lambda r, lim: []), "prompt"),
    "ids_out_of_vocab": (_ids(lambda r, lim: [1, 2**32 - 1]), "prompt_token_ids"),
    "chat_empty": (_chat(), "chat.messages"),
    "chat_bad_role": (_chat(("robot", "hi")), "role"),
    "chat_too_many_messages": (lambda req, r, lim: _chat(*[("user", "")] * lim.max_model_len)(req, r, lim),
                               "chat.messages"),
}


MARK = "Zq7#Mk2!"  # 8 bytes no request holds by chance: the placeholder a raw case overwrites in place
NOT_UTF8 = [bytes([0xFF, 0xFE, 0xC3, 0x28, 0xA0, 0xA1, 0xE2, 0x28]),  # as long as MARK: length prefixes stay right
            b"ab\xed\xa0\x80cde",  # a UTF-16 surrogate (U+D800) written as UTF-8: what a lone surrogate becomes
            b"\xc0\xafabcdef",  # an overlong "/"
            b"abcdefg\xe2"]  # cut inside a character


def _non_utf8(place: Callable[[pb.GenerateRequest, str], None]) -> Callable[[random.Random, Limits], bytes]:
    """A valid request with `place` putting MARK in one string field, serialized, MARK's bytes then replaced by
    bytes that are not UTF-8 (no client library would send them; grpc's parser refuses them)."""
    def build(rng: random.Random, limits: Limits) -> bytes:
        req = base_request(rng, limits)
        place(req, MARK)
        return req.SerializeToString().replace(MARK.encode(), rng.choice(NOT_UTF8))
    return build


def _chat_message(role: str, content: str):
    def place(req, mark):
        req.ClearField("input")
        req.chat.messages.extend([pb.ChatMessage(role="user", content="hi"),
                                  pb.ChatMessage(role=mark if role == "MARK" else role,
                                                 content=mark if content == "MARK" else content)])
    return place


def _raw_truncated(rng: random.Random, limits: Limits) -> bytes:
    return base_request(rng, limits).SerializeToString()[:-1] + b"\x0a\xff"  # a length prefix past the end


# name -> (raw bytes, the field INVALID_ARGUMENT must name): every string field of GenerateRequest once
RAW: dict[str, tuple[Callable[[random.Random, Limits], bytes], str]] = {
    "invalid_utf8_prompt": (_non_utf8(lambda req, mark: setattr(req, "prompt", mark)), "prompt"),
    "invalid_utf8_request_id": (_non_utf8(lambda req, mark: setattr(req, "request_id", mark)), "request_id"),
    "invalid_utf8_chat_content": (_non_utf8(_chat_message("user", "MARK")), "chat.messages[1].content"),
    "invalid_utf8_chat_role": (_non_utf8(_chat_message("MARK", "hi")), "chat.messages[1].role"),
    "invalid_utf8_stop": (_non_utf8(lambda req, mark: req.sampling.stop.extend(["x", mark])), "sampling.stop[1]"),
    "invalid_utf8_method_name": (_non_utf8(lambda req, mark: setattr(req.spec, "method_name", mark)),
                                 "spec.method_name"),
    "invalid_utf8_retrieval": (_non_utf8(lambda req, mark: req.spec.retrieval.append(mark)), "spec.retrieval[0]"),
    "invalid_utf8_shape_name": (_non_utf8(lambda req, mark: setattr(req.spec.tree, "shape_name", mark)),
                                "spec.tree.shape_name"),
    "truncated": (_raw_truncated, "request"),
}


def make_case(rng: random.Random, limits: Limits) -> Case:
    """One case: valid (40%), invalid in one field (50%), or raw bytes (10%)."""
    req = base_request(rng, limits)
    roll = rng.random()
    for name in rng.sample(sorted(VALID), rng.randint(0, 3)):
        if name != "long_prompt" or rng.random() < 0.1:  # long prompts are slow: a few are enough
            VALID[name](req, rng, limits)
    if roll < 0.4:
        return Case("valid", req, None)
    if roll < 0.9:
        name = rng.choice(sorted(INVALID))
        mutate, field = INVALID[name]
        mutate(req, rng, limits)
        return Case(name, req, field)
    name = rng.choice(sorted(RAW))
    build, field = RAW[name]
    return Case(name, build(rng, limits), field)


@dataclass
class Outcome:
    case: Case
    code: str  # a grpc.StatusCode name, "OK", or "HANG"
    details: str
    tokens: int = 0
    finish_reason: str = ""

    @property
    def ok(self) -> bool:
        if self.case.field is None:
            return self.code == "OK" and self.finish_reason in ("stop", "length") and \
                self.tokens <= max(self.case.request.sampling.max_tokens, 1)
        return self.code == "INVALID_ARGUMENT" and self.case.field in self.details


def send(channel, case: Case, metadata, timeout_s: float, stream: bool) -> Outcome:
    """One case over the raw API (bytes in, bytes out, so malformed requests go out as they are)."""
    import grpc
    payload = case.request if isinstance(case.request, bytes) else case.request.SerializeToString()
    method = "/evospec.v1.Generate/" + ("Generate" if stream else "GenerateOnce")
    call = (channel.unary_stream if stream else channel.unary_unary)(
        method, request_serializer=lambda b: b, response_deserializer=pb.GenerateResponse.FromString)
    try:
        replies = list(call(payload, timeout=timeout_s, metadata=metadata)) if stream else \
            [call(payload, timeout=timeout_s, metadata=metadata)]
    except grpc.RpcError as err:
        code = "HANG" if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED else err.code().name
        return Outcome(case, code, err.details() or "")
    return Outcome(case, "OK", "", sum(len(r.token_ids) for r in replies) if stream else len(replies[0].token_ids),
                   finish_reason(replies[-1]) if replies else "")


def finish_reason(reply: pb.GenerateResponse) -> str:
    """"stop" | "length" | "" from the enum (the fuzz judges the enum, not its string form)."""
    return enum_string(pb.FinishReason.DESCRIPTOR, reply.finish_reason) or ""


def limits_of(info: dict) -> Limits:
    return Limits(int(info["max_model_len"]), int(info["static_vocab_size"]), int(info["max_prompt_bytes"]))


def run_fuzz(address: str, cases: int, seed: int = 0, concurrency: int = 4, timeout_s: float = 120.0,
             token: str | None = None, app_name: str = "evospec") -> dict:
    """Send `cases` cases; returns the summary (and prints failures as they happen)."""
    import grpc
    from tqdm import tqdm

    from evospec_client import EvoSpecClient
    from evospec_client.sdk import call_metadata
    with EvoSpecClient(address, app_name=app_name, token=token) as client:
        info = client.wait_ready(120)
    limits = limits_of(info)
    rng = random.Random(seed)
    batch = [make_case(rng, limits) for _ in range(cases)]
    metadata = call_metadata(app_name, token)
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    outcomes: list[Outcome] = []
    start = time.monotonic()
    with grpc.insecure_channel(address, options=options) as channel, ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(send, channel, case, metadata, timeout_s, i % 2 == 0) for i, case in enumerate(batch)]
        for future in tqdm(futures, desc="fuzz", unit="case"):
            outcome = future.result()
            outcomes.append(outcome)
            if not outcome.ok:
                tqdm.write(f"FAIL {outcome.case.name}: {outcome.code} {outcome.details[:200]!r}")
        health = _health(channel, metadata)
    return summarize(outcomes, time.monotonic() - start, health)


def _health(channel, metadata) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10,
                                                          metadata=metadata)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"unreachable ({exc.__class__.__name__})"


def summarize(outcomes: list[Outcome], seconds: float, health: str) -> dict:
    valid = [o for o in outcomes if o.case.field is None]
    invalid = [o for o in outcomes if o.case.field is not None]
    return {
        "cases": len(outcomes), "seconds": round(seconds, 1), "health_after": health,
        "valid": len(valid), "valid_failed": sum(not o.ok for o in valid),
        "invalid": len(invalid), "invalid_not_invalid_argument": sum(o.code != "INVALID_ARGUMENT" for o in invalid),
        "invalid_field_not_named": sum(o.code == "INVALID_ARGUMENT" and not o.ok for o in invalid),
        "hangs": sum(o.code == "HANG" for o in outcomes),
        "codes": dict(Counter(o.code for o in outcomes)),
        "failures": [{"case": o.case.name, "code": o.code, "details": o.details[:300]} for o in outcomes if not o.ok],
    }


# ---- the OpenAI front (--api openai) -------------------------------------------------------------------------------
# One catalogue for both routes: a parameter and values of it that must be refused with a 400 naming it (wrong JSON
# types, integers past the gRPC API's widths, text that is not Unicode, what docs/openai.md lists as refused). The
# unit tests (tests/unit/test_openai_api.py) run every entry; `evospec fuzz --api openai` samples them.
HTTP_INVALID: dict[str, list] = {
    "max_tokens": ["4", True, 4.5, 0, -1, 2 ** 32, 2 ** 64, [4]],
    "max_completion_tokens": ["4", True, 4.5, 0, -1, 2 ** 32],
    "temperature": ["0", True, -1, 101, [0.5]],
    "top_p": ["1", False, 0, 1.5],
    "top_k": ["5", True, -2, 2 ** 32, 2 ** 63, 2 ** 64, 1.5],
    "seed": ["1", True, -1, 2 ** 64, 1.5],
    "stream": ["yes", 1, {}],
    "ignore_eos": ["true", 0],
    "stop": [1, [1], ["a", 2], "\ud800", ["ok", "\udbff"], [""], ["x"] * 17],
    "model": [5, "\udc00", "gpt-4"],
    "n": ["1", True, 2],
    "best_of": [2, "1"],
    "presence_penalty": [0.5, "0"],
    "frequency_penalty": [-0.5],
    "logit_bias": [{"5": 1.0}],
    "logprobs": ["yes", True, 3],
    "top_logprobs": [1, "1"],
    "tools": [[{"type": "function"}], "x"],
    "tool_choice": ["auto", {"type": "function"}],
    "response_format": [{"type": "json_object"}, "text"],
    "echo": [True, "no"],
    "suffix": ["end"],
    "stream_options": ["yes", {"include_usage": "yes"}],
    "speculation": ["evospec", {"method": "eagle"}, {"predraft": "yes"}, {"depth": 2 ** 32}, {"unknown": 1},
                    {"dynamic_size": -1}, {"retrieval": ["magic"]}],
}
HTTP_VALID: dict[str, list] = {
    "top_k": [-1, 0, 2 ** 32 - 1], "seed": [0, 2 ** 64 - 1], "temperature": [0, 1], "stream": [None, True],
    "ignore_eos": [None, True], "logprobs": [None, False], "n": [1], "tool_choice": ["none"],
    "response_format": [{"type": "text"}], "echo": [False], "unknown_field": ["\u00e9", 5],
    "speculation": [{"method": "ar"}, {"method": "evospec", "depth": 2}, {"retrieval": []},
                    {"method": "evospec", "retrieval": ["target", "statistical"]}],
    "stop": [["\n\n"]], "max_completion_tokens": [None, 1],
}
HTTP_NOT_FOUND = [("model", "gpt-4")]  # refused with 404 model_not_found (it names `model` too)
HTTP_ROUTES = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}
HTTP_RAW = {"not_json": b"{not json", "nan": b'{"prompt": "hi", "temperature": NaN}',
            "infinity": b'{"prompt": "hi", "top_p": Infinity}', "not_utf8": b'{"prompt": "\xff\xfe"}',
            "not_an_object": b"[1, 2]"}


def names_param(param: str | None, expected: str) -> bool:
    """An OpenAI error's `param` names `expected` or an element of it (`stop[1]`, `speculation.depth`)."""
    return param is not None and (param == expected or param.startswith((expected + ".", expected + "[")))


@dataclass
class HttpCase:
    name: str
    route: str
    body: dict | bytes
    param: str | None  # None = valid; else the parameter the 4xx must name
    status: int = 400


def base_body(rng: random.Random, route: str, max_tokens: int) -> dict:
    body = {"max_tokens": rng.randint(1, max_tokens)}
    if route == "/v1/chat/completions":
        body["messages"] = [{"role": rng.choice(["system", "user", "assistant", "developer"]),
                             "content": rng.choice(["hi", "", "Doses? 😀", "Ünïcödé ✓ 测试"])}
                            for _ in range(rng.randint(0, 2))] + [{"role": "user", "content": "Is aspirin useful?"}]
    else:
        body["prompt"] = rng.choice(["Is aspirin useful after a stroke?", "def f(x):\n    return", [5, 6, 7]])
    return body


def make_http_case(rng: random.Random, max_tokens: int = 6) -> HttpCase:
    """One case: valid (40%), one parameter invalid (50%), or a body that is not a JSON object of text (10%)."""
    route = rng.choice(sorted(HTTP_ROUTES))
    body = base_body(rng, route, max_tokens)
    roll = rng.random()
    if roll < 0.4:
        param = rng.choice(sorted(HTTP_VALID))
        return HttpCase(f"valid_{param}", route, {**body, param: rng.choice(HTTP_VALID[param])}, None)
    if roll < 0.9:
        param = rng.choice(sorted(HTTP_INVALID))
        value = rng.choice(HTTP_INVALID[param])
        return HttpCase(f"invalid_{param}", route, {**body, param: value}, param,
                        404 if (param, value) in HTTP_NOT_FOUND else 400)
    name = rng.choice(sorted(HTTP_RAW))
    return HttpCase(f"raw_{name}", route, HTTP_RAW[name], "body")


@dataclass
class HttpOutcome:
    case: HttpCase
    status: int | str  # the HTTP status, or "HANG"
    param: str | None
    detail: str

    @property
    def ok(self) -> bool:
        if self.case.param is None:
            return self.status == 200
        return self.status == self.case.status and names_param(self.param, self.case.param)


def send_http(http, case: HttpCase, timeout_s: float) -> HttpOutcome:
    """One case over the OpenAI front: a valid one must complete (non-streaming: a choice with a finish reason;
    streaming: SSE ending in [DONE]); an invalid one must get its 4xx naming the parameter."""
    import httpx2
    content = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
    try:
        r = http.post(case.route, content=content, headers={"content-type": "application/json"}, timeout=timeout_s)
    except httpx2.TimeoutException:
        return HttpOutcome(case, "HANG", None, "")
    if r.status_code != 200:
        try:
            error = r.json()["error"]
        except (ValueError, KeyError, TypeError):
            return HttpOutcome(case, r.status_code, None, r.text[:300])
        return HttpOutcome(case, r.status_code, error.get("param"), str(error.get("message"))[:300])
    streamed = isinstance(case.body, dict) and case.body.get("stream")
    complete = r.text.rstrip().endswith("data: [DONE]") if streamed else \
        r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    return HttpOutcome(case, 200 if complete else "INCOMPLETE", None, "" if complete else r.text[-300:])


def run_http_fuzz(base_url: str, cases: int, seed: int = 0, concurrency: int = 4, timeout_s: float = 120.0,
                  token: str | None = None) -> dict:
    """Send `cases` HTTP cases to the OpenAI front at `base_url`; returns the summary (failures printed as found)."""
    import os

    import httpx2
    from tqdm import tqdm
    token = token or os.environ.get("EVOSPEC_API_TOKEN")
    rng = random.Random(seed)
    batch = [make_http_case(rng) for _ in range(cases)]
    headers = {"authorization": f"Bearer {token}"} if token else {}
    outcomes: list[HttpOutcome] = []
    start = time.monotonic()
    with httpx2.Client(base_url=base_url, headers=headers) as http, ThreadPoolExecutor(concurrency) as pool:
        for future in tqdm([pool.submit(send_http, http, case, timeout_s) for case in batch], desc="fuzz openai",
                           unit="case"):
            outcome = future.result()
            outcomes.append(outcome)
            if not outcome.ok:
                tqdm.write(f"FAIL {outcome.case.name} {outcome.case.route}: {outcome.status} "
                           f"param={outcome.param!r} {outcome.detail[:200]!r}")
        health = http.get("/health", timeout=10).status_code
    valid = [o for o in outcomes if o.case.param is None]
    invalid = [o for o in outcomes if o.case.param is not None]
    return {"api": "openai", "cases": len(outcomes), "seconds": round(time.monotonic() - start, 1),
            "health_after": "SERVING" if health == 200 else f"HTTP {health}",
            "valid": len(valid), "valid_failed": sum(not o.ok for o in valid),
            "invalid": len(invalid),
            "invalid_not_invalid_argument": sum(o.status != o.case.status for o in invalid),
            "invalid_field_not_named": sum(o.status == o.case.status and not o.ok for o in invalid),
            "server_errors": sum(isinstance(o.status, int) and o.status >= 500 for o in outcomes),
            "hangs": sum(o.status == "HANG" for o in outcomes),
            "codes": dict(Counter(str(o.status) for o in outcomes)),
            "failures": [{"case": o.case.name, "route": o.case.route, "status": o.status, "param": o.param,
                          "detail": o.detail} for o in outcomes if not o.ok]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evospec fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--api", choices=["grpc", "openai"], default="grpc",
                    help="the public front to fuzz: the gRPC API, or the OpenAI-compatible HTTP routes")
    ap.add_argument("--address", default=None, help="a running service: its gRPC address, or with --api openai its "
                                                    "HTTP base URL (default: start one from --config)")
    ap.add_argument("--config", default="cpu-tiny.yaml", help="service config when starting a local service")
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=120.0, help="per-call deadline; past it a case is a hang")
    ap.add_argument("--token", default=None, help="bearer token (default: $EVOSPEC_API_TOKEN)")
    ap.add_argument("--out", default=None, help="write the summary as JSON here")
    args = ap.parse_args(argv)
    if args.api == "openai":
        with http_service_to_drive(args.address, args.config) as (base_url, _):
            summary = run_http_fuzz(base_url, args.cases, args.seed, args.concurrency, args.timeout, args.token)
    else:
        with service_to_drive(args.address, args.config) as (address, app_name):
            summary = run_fuzz(address, args.cases, args.seed, args.concurrency, args.timeout, args.token, app_name)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    failed = summary["valid_failed"] + summary["invalid_not_invalid_argument"] + summary["invalid_field_not_named"]
    return 0 if failed == 0 and summary["health_after"] == "SERVING" else 1
