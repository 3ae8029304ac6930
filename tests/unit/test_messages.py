"""One field list: the typed config (evospec/config.py) and the public messages (evospec.v1) name the same request
fields, and every front derives its list from them (gRPC: services/common/messages.py, OpenAI: the `speculation`
extension, SDK: `build_request`, CLI: the request flags). A field added on one side only fails here."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evospec.config import (
    SPEC_OPTIONS,
    SamplingParams,
    SpecParams,
    TreeParams,
    VocabParams,
    get_args,
    spec_options,
    spec_with,
)
from evospec.errors import InvalidRequestError
from evospec.orchestration.cli import build_parser
from evospec.services.common.messages import (
    LEGACY_SUFFIX,
    NOT_TYPED,
    sampling_from_proto,
    sampling_to_proto,
    spec_from_proto,
    spec_to_proto,
)
from evospec.services.target.grpc_api import finished_to_proto
from evospec.services.target.openai_api import SpeculationOptions
from evospec.services.target.server import FinishedEvent
from evospec_client import sdk
from evospec_client.api.v1 import generate_pb2 as pb


def proto_fields(*messages) -> set[str]:
    """Request fields of these messages: no sub-messages, no enums' earlier string forms."""
    return {f.name for m in messages for f in m.DESCRIPTOR.fields
            if f.message_type is None and not f.name.endswith(LEGACY_SUFFIX)}


def test_typed_config_and_public_messages_name_the_same_fields():
    assert set(SamplingParams.model_fields) == proto_fields(pb.SamplingParams) - NOT_TYPED
    assert set(SPEC_OPTIONS) == proto_fields(pb.SpecParams, pb.TreeParams)
    for enum_field in ("method", "shape"):  # each closed set: an enum whose values are the typed strings
        holder = pb.SpecParams if enum_field == "method" else pb.TreeParams
        enum = holder.DESCRIPTOR.fields_by_name[enum_field].enum_type
        field = SpecParams.model_fields["method"] if enum_field == "method" else TreeParams.model_fields["shape"]
        assert {v.name.split("_")[-1].lower() for v in enum.values if v.number} == set(get_args(field.annotation))


def test_every_front_derives_its_list_from_them():
    assert set(SpeculationOptions.model_fields) == set(SPEC_OPTIONS)  # OpenAI's `speculation`
    assert set(sdk.OPTIONS) == set(SamplingParams.model_fields) | NOT_TYPED | set(SPEC_OPTIONS)  # the SDK's kwargs
    flags = vars(build_parser().parse_args(["generate"]))
    assert set(SamplingParams.model_fields) | set(SPEC_OPTIONS) <= set(flags)  # the CLI's flags


specs = st.builds(
    SpecParams, method=st.sampled_from(["ar", "sd", "frspec", "evospec", "lookup"]),
    tree=st.builds(TreeParams, shape=st.sampled_from(["chain", "tree"]), num_draft_tokens=st.integers(1, 64),
                   depth=st.integers(1, 16), branching=st.integers(1, 16), budget=st.integers(1, 256)),
    vocab=st.builds(VocabParams, static_size=st.integers(1, 2**31), dynamic_size=st.integers(0, 4096),
                    retrieval=st.lists(st.sampled_from(["statistical", "semantic", "target"]), min_size=1,
                                       unique=True).map(tuple)),
    predraft=st.booleans())
# The wire's temperature and top_p are float32: exact round trips for values float32 holds (0.75, not 0.7).
samplings = st.builds(SamplingParams, max_tokens=st.integers(1, 2**31), temperature=st.sampled_from([0.0, 0.75, 2.0]),
                      top_p=st.sampled_from([0.5, 1.0]), top_k=st.integers(0, 2**31),
                      seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)), ignore_eos=st.booleans())


@given(spec=specs, sampling=samplings, defaults=specs)
def test_typed_to_proto_and_back_is_exact(spec, sampling, defaults):
    assert spec_from_proto(spec_to_proto(spec), defaults) == spec  # every option set: the defaults never leak in
    assert sampling_from_proto(sampling_to_proto(sampling)) == sampling
    assert spec_with(defaults, spec_options(spec)) == spec


def test_unset_fields_take_the_servers_defaults():
    defaults = SpecParams(method="frspec", tree={"depth": 3}, vocab={"static_size": 1024})
    request = pb.SpecParams()
    request.tree.depth = 2
    assert spec_from_proto(request, defaults) == defaults.model_copy(update={"tree": TreeParams(depth=2)})
    assert sampling_from_proto(pb.SamplingParams()) == SamplingParams()


def test_clients_built_before_the_enums_still_work():
    """The string forms are read when the enum is unset, and answers carry both forms."""
    old = pb.SpecParams(method_name="sd")
    old.tree.shape_name = "tree"
    spec = spec_from_proto(old, SpecParams())
    assert (spec.method, spec.tree.shape) == ("sd", "tree")
    reply = finished_to_proto(FinishedEvent("r", "length", {"method": "evospec", "steps": 3}))
    assert (reply.finish_reason, reply.finish_reason_name) == (pb.FINISH_REASON_LENGTH, "length")
    assert (reply.stats.method, reply.stats.method_name) == (pb.METHOD_EVOSPEC, "evospec")
    delta = sdk._delta(reply)  # the SDK gives strings, as before the enums
    assert (delta.finish_reason, delta.stats["method"]) == ("length", "evospec") and "method_name" not in delta.stats
    from_old_server = pb.GenerateResponse(finish_reason_name="stop")
    from_old_server.stats.method_name = "sd"
    assert (sdk._delta(from_old_server).finish_reason, sdk._delta(from_old_server).stats["method"]) == ("stop", "sd")


@pytest.mark.parametrize("request_spec,field", [
    (pb.SpecParams(method=99), "spec.method"),
    (pb.SpecParams(method=pb.METHOD_SD, method_name="frspec"), "spec.method"),
    (pb.SpecParams(method_name="medusa"), "spec.method"),
    (pb.SpecParams(tree=pb.TreeParams(shape=9)), "spec.tree.shape"),
    (pb.SpecParams(tree=pb.TreeParams(depth=0)), "spec.tree.depth"),
    (pb.SpecParams(dynamic_size=10**6), "spec.dynamic_size"),
    (pb.SpecParams(retrieval=["target", "magic"]), "spec.retrieval[1]"),
])
def test_bad_values_name_the_proto_field(request_spec, field):
    with pytest.raises(InvalidRequestError) as err:
        spec_from_proto(request_spec, SpecParams())
    assert err.value.field == field


def test_the_sdk_names_the_field_of_a_value_the_wire_cannot_hold():
    for options, field in [({"seed": -5}, "sampling.seed"), ({"top_k": 2**32}, "sampling.top_k"),
                           ({"method": "medusa"}, "spec.method"), ({"depth": -1}, "spec.tree.depth")]:
        with pytest.raises(sdk.InvalidArgument, match=field):
            sdk.build_request("hi", **options)
    for inputs, field in [({"prompt_token_ids": [1, -1]}, "prompt_token_ids"),
                          ({"prompt_token_ids": [2**32]}, "prompt_token_ids"), ({"prompt": 5}, "prompt"),
                          ({"messages": [{"role": "user", "text": "hi"}]}, "chat"),
                          ({"messages": [{"role": "user", "content": 5}]}, "chat")]:
        with pytest.raises(sdk.InvalidArgument, match=field):
            sdk.build_request(**inputs)
    with pytest.raises(TypeError, match="unknown request option"):
        sdk.build_request("hi", temprature=0.5)
    request = sdk.build_request("hi", method="frspec", shape="tree", depth=3, retrieval=["target"], seed=2**64 - 1)
    assert (request.spec.method, request.spec.tree.shape, request.spec.tree.depth) == (
        pb.METHOD_FRSPEC, pb.TREE_SHAPE_TREE, 3)
