"""Bad input to the engine API raises InvalidRequestError naming the field to fix."""
import math

import pytest
import torch

from evospec.config import SamplingParams, SpecParams, TreeParams, validated
from evospec.engine.generate import SpeculativeDecoder
from evospec.errors import InvalidRequestError
from evospec.testing import random_pair


@pytest.fixture(scope="module")
def decoder():
    target, draft = random_pair(vocab=64, seed=0)
    return SpeculativeDecoder(target, draft, static_ids=torch.arange(32), max_model_len=64)


@pytest.mark.parametrize("values,field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"bogus": 1}, "bogus"),
])
def test_sampling_params(values, field):
    with pytest.raises(InvalidRequestError) as e:
        validated(SamplingParams, **values)
    assert e.value.field == field


@pytest.mark.parametrize("values,field", [
    ({"budget": 0}, "budget"), ({"depth": 0}, "depth"), ({"num_draft_tokens": 0}, "num_draft_tokens"),
    ({"shape": "star"}, "shape"),
])
def test_tree_params(values, field):
    with pytest.raises(InvalidRequestError) as e:
        validated(TreeParams, **values)
    assert e.value.field == field


def test_unknown_method():
    with pytest.raises(InvalidRequestError) as e:
        validated(SpecParams, method="medusa")
    assert e.value.field == "method"


@pytest.mark.parametrize("prompt,max_tokens,field", [
    ([], 4, "prompt"),
    ([1] * 64, 4, "prompt"),
    ([1] * 80, 4, "prompt"),
    ([1] * 60, 10, "sampling.max_tokens"),
    ([1, 64], 4, "prompt_token_ids"),
    ([1, -2], 4, "prompt_token_ids"),
])
def test_prompt_and_context(decoder, prompt, max_tokens, field):
    with pytest.raises(InvalidRequestError) as e:
        decoder.generate(prompt, SamplingParams(max_tokens=max_tokens), SpecParams(method="sd"))
    assert e.value.field == field


def test_static_size_larger_than_artifact(decoder):
    with pytest.raises(InvalidRequestError) as e:
        decoder.generate([1, 2], SamplingParams(max_tokens=4), SpecParams(method="frspec", vocab={"static_size": 33}))
    assert e.value.field == "spec.vocab.static_size"


def test_method_without_draft_model():
    target, _ = random_pair(vocab=64, seed=0)
    with pytest.raises(InvalidRequestError, match="needs a draft model"):
        SpeculativeDecoder(target).generate([1, 2], SamplingParams(max_tokens=4), SpecParams(method="sd"))


def test_status_codes_mapping():
    import grpc

    from evospec.errors import OverloadedError
    from evospec.services.common.errors import status_for
    assert status_for(InvalidRequestError("x", "y")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_for(OverloadedError("busy")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    from evospec.errors import ShuttingDownError
    assert status_for(ShuttingDownError("shutting down")) == grpc.StatusCode.UNAVAILABLE  # the SDK retries it
    assert status_for(TimeoutError()) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert status_for(RuntimeError()) == grpc.StatusCode.INTERNAL


def test_invalid_request_error_pickles():
    import pickle
    e = pickle.loads(pickle.dumps(InvalidRequestError("sampling.top_p", "must be <= 1")))
    assert (e.field, e.message, str(e)) == ("sampling.top_p", "must be <= 1", "sampling.top_p: must be <= 1")


def test_draft_stream_errors_keep_their_status():
    import pickle

    import grpc

    from evospec.services.common.errors import status_for
    from evospec.services.target.remote_draft import DraftStreamError
    err = pickle.loads(pickle.dumps(DraftStreamError("draft: gone", "UNAVAILABLE")))
    assert status_for(err) == grpc.StatusCode.UNAVAILABLE and str(err) == "draft: gone"
