"""`evospec fuzz`: random valid and invalid requests against a running service, over the raw public API.

Every case is a valid base request with mutations from one catalogue (`VALID` keeps it valid, `INVALID` breaks one
named field), or raw bytes the proxy must not choke on. A case passes when a valid request completes (OK, at most
max_tokens tokens, a finish reason) and an invalid one gets INVALID_ARGUMENT whose message names the field. Anything
else is a failure: another status (INTERNAL, UNKNOWN...), a crash, or a hang (the per-call deadline). The same
catalogue drives the property-based test in CI (tests/unit/test_hardening.py, with hypothesis).

    evospec fuzz --cases 1000                              # starts a local service (cpu-tiny.yaml)
    evospec fuzz --address 127.0.0.1:9000 --cases 1000     # a running service
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

from evospec.orchestration.local import service_to_drive
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
    method = rng.choice(["", "ar", "sd", "frspec", "evospec"])
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


def _raw_with_invalid_utf8(rng: random.Random, limits: Limits) -> bytes:
    """A request whose prompt (field 2, a proto3 string) holds bytes that are not UTF-8."""
    text = bytes([0xFF, 0xFE, 0xC3]) + bytes(rng.randrange(256) for _ in range(rng.randint(0, 20)))
    return b"\x12" + bytes([len(text)]) + text


def _raw_truncated(rng: random.Random, limits: Limits) -> bytes:
    return base_request(rng, limits).SerializeToString()[:-1] + b"\x0a\xff"  # a length prefix past the end


RAW: dict[str, Callable[[random.Random, Limits], bytes]] = {"invalid_utf8": _raw_with_invalid_utf8,
                                                           "truncated": _raw_truncated}


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
    return Case(name, RAW[name](rng, limits), "request")


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evospec fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", default=None, help="a running service (default: start one from --config)")
    ap.add_argument("--config", default="cpu-tiny.yaml", help="service config when starting a local service")
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=120.0, help="per-call deadline; past it a case is a hang")
    ap.add_argument("--token", default=None, help="bearer token (default: $EVOSPEC_API_TOKEN)")
    ap.add_argument("--out", default=None, help="write the summary as JSON here")
    args = ap.parse_args(argv)
    with service_to_drive(args.address, args.config) as (address, app_name):
        summary = run_fuzz(address, args.cases, args.seed, args.concurrency, args.timeout, args.token, app_name)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    failed = summary["valid_failed"] + summary["invalid_not_invalid_argument"] + summary["invalid_field_not_named"]
    return 0 if failed == 0 and summary["health_after"] == "SERVING" else 1
