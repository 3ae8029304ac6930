"""The OpenAI-compatible front through Serve's real HTTP proxy: the official `openai` client streams and
non-streams both endpoints, greedy text through HTTP equals the gRPC SDK's, errors keep OpenAI's JSON through the
proxy, and /metrics moves by each request's statistics while showing it running."""
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from evospec.testing import prometheus_values

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

QUESTION = "Is a high body mass index associated with worse outcomes after surgery for colorectal cancer?"
MESSAGES = [{"role": "user", "content": QUESTION}]
GREEDY = {"temperature": 0, "max_tokens": 32}


@pytest.fixture(scope="module")
def base_url(service):
    return f"http://127.0.0.1:{service[1].http_port}"


@pytest.fixture(scope="module")
def oai(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=120, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


@pytest.mark.parametrize("method", ["ar", "evospec"])
def test_chat_through_http_equals_grpc_greedy(oai, model, client, method):
    extra = {"speculation": {"method": method}}
    whole = oai.chat.completions.create(model=model, messages=MESSAGES, extra_body=extra, **GREEDY)
    chunks = list(oai.chat.completions.create(model=model, messages=MESSAGES, stream=True, extra_body=extra,
                                              stream_options={"include_usage": True}, **GREEDY))
    grpc = client.generate(messages=MESSAGES, max_tokens=GREEDY["max_tokens"], method=method)
    text = whole.choices[0].message.content
    assert text == grpc.text and len(grpc.token_ids) == whole.usage.completion_tokens
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert whole.choices[0].finish_reason == grpc.finish_reason == chunks[-2].choices[0].finish_reason
    usage = chunks[-1].usage
    assert usage.completion_tokens == whole.usage.completion_tokens and usage.prompt_tokens > 0
    assert usage.model_extra["speculation"]["method"] == method


def test_completions_through_http_equals_grpc_greedy(oai, model, client):
    prompt = "Question: " + QUESTION + "\nAnswer:"
    whole = oai.completions.create(model=model, prompt=prompt, **GREEDY)
    streamed = "".join(c.choices[0].text for c in oai.completions.create(model=model, prompt=prompt, stream=True,
                                                                          **GREEDY))
    grpc = client.generate(prompt, max_tokens=GREEDY["max_tokens"])
    assert whole.choices[0].text == streamed == grpc.text
    assert whole.usage.model_extra["speculation"]["tau"] >= 1


def test_errors_keep_openai_json_through_the_proxy(oai, model, base_url):
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(model=model, messages=MESSAGES, n=2)
    assert bad.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    with urllib.request.urlopen(f"{base_url}/health", timeout=30) as r:
        assert r.status == 200


def scrape(base_url) -> dict[str, float]:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as r:
        return prometheus_values(r.read().decode())


def test_metrics_scraped_during_a_generation_move_by_its_statistics(oai, model, base_url):
    before = scrape(base_url)
    mid = []
    stream = oai.completions.create(model=model, prompt=QUESTION, stream=True, stream_options={"include_usage": True},
                                    extra_body={"ignore_eos": True, "speculation": {"method": "frspec"}},
                                    temperature=0, max_tokens=64)
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 2:
            scraper = threading.Thread(target=lambda: mid.append(scrape(base_url)))
            scraper.start()
            scraper.join(timeout=30)
    after = scrape(base_url)
    stats = chunks[-1].usage.model_extra["speculation"]
    assert mid and mid[0]["vllm:num_requests_running"] >= 1

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)
    m = "|method=frspec"
    assert delta(f"vllm:spec_decode_num_drafts_total{m}") == stats["steps"] > 0
    assert delta(f"vllm:spec_decode_num_draft_tokens_total{m}") == stats["drafted"]
    assert delta(f"vllm:spec_decode_num_accepted_tokens_total{m}") == stats["accepted"]
    assert delta(f"vllm:generation_tokens_total{m}") == stats["generated_tokens"] == 64
    assert delta(f"vllm:time_to_first_token_seconds_count{m}") == 1
    assert delta(f"evospec:verified_positions_total{m}") == stats["verified_positions"]
    assert after["vllm:num_requests_running"] == 0


def test_a_body_over_the_limit_gets_413_not_a_reset(base_url):
    """A client that sends its whole over-limit body (17 MiB, the limit is 16) before it reads, and closes the
    connection after one request (urllib does both), gets the 413 through Serve's proxy, not a connection reset (it
    did while the front answered before reading the body)."""
    from evospec.services.target.ingress import max_request_bytes
    body = b'{"prompt": "' + b"x" * (max_request_bytes() + (1 << 20)) + b'"}'
    request = urllib.request.Request(f"{base_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=120)
    assert e.value.code == 413 and b"at most" in e.value.read()


def test_unknown_path_is_openai_404(base_url):
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{base_url}/v1/embeddings", timeout=30)
    assert e.value.code == 404 and b'"error"' in e.value.read()


def test_a_client_that_disconnects_mid_stream_frees_both_sides(oai, model):
    """Closing the HTTP stream after two chunks cancels the generation through Serve's HTTP proxy: the target's
    and the draft's sessions are freed (as the gRPC cancel test checks for the SDK)."""
    from ray import serve

    def sessions():
        return serve.get_app_handle("evospec").num_sessions.remote().result(timeout_s=30)
    stream = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=400, stream=True,
                                         extra_body={"ignore_eos": True, "speculation": {"method": "evospec"}})
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    assert sessions() == {"target": 1, "draft": 1}
    stream.close()  # closes the HTTP connection
    deadline = time.monotonic() + 30
    while sessions() != {"target": 0, "draft": 0} and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sessions() == {"target": 0, "draft": 0}
