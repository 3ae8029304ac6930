"""The public messages (evospec.v1 SamplingParams, SpecParams, TreeParams) <-> the typed config, driven by the
pydantic fields: the gRPC front reads requests with it and the internal protocol's StartSession carries the same
messages, so a new request field is declared once in evospec/config.py plus its proto line (tests/unit/test_messages.py
fails when the two lists disagree).

Conventions of the public proto that this module implements once:
- a typed field `x` is the proto field `x` of the same name; `optional` scalars and enums left at 0 are unset (the
  typed default, or the server's for speculation); plain scalars (`top_k`, `ignore_eos`) are read as they are, their
  zero being the typed default;
- a closed set is an enum whose value names are the typed strings, upper-cased, after the enum's prefix
  (Method.METHOD_EVOSPEC = "evospec"); its earlier string field `x_name` is still read (a client built before the
  enum) and always written.
"""
from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor

from evospec.config import SPEC_OPTIONS, SamplingParams, SpecParams, spec_options, spec_with, validated
from evospec.errors import InvalidRequestError
from evospec_client.api.v1 import generate_pb2 as pb
from evospec_client.enums import LEGACY_SUFFIX, enum_number, enum_string

NOT_TYPED = {"stop"}  # public SamplingParams fields outside the typed SamplingParams (text-level: TextStream)


def read_field(msg, name: str, path: str):
    """The value a request gives field `name` of `msg` (typed form), or None when it leaves it unset. `path` names the
    field in errors (spec.tree.shape)."""
    field = msg.DESCRIPTOR.fields_by_name[name]
    value = getattr(msg, name)
    if field.enum_type is not None:
        return _read_enum(msg, field, path)
    if field.is_repeated:
        return tuple(value) if value else None
    if field.has_presence:
        return value if msg.HasField(name) else None
    return value


def _read_enum(msg, field: FieldDescriptor, path: str) -> str | None:
    number = getattr(msg, field.name)
    chosen = enum_string(field.enum_type, number)
    if number and chosen is None:
        raise InvalidRequestError(path, f"{number} is not a {field.enum_type.full_name} value")
    legacy = field.containing_type.fields_by_name.get(field.name + LEGACY_SUFFIX)
    named = getattr(msg, legacy.name) if legacy is not None else ""
    if chosen is not None and named and named != chosen:
        raise InvalidRequestError(path, f"is {chosen!r} but {field.name}{LEGACY_SUFFIX} says {named!r}: set one")
    return chosen or named or None


def write_field(msg, name: str, value) -> None:
    """Set field `name` of `msg` from its typed value (an enum also fills its string form `x_name`)."""
    field = msg.DESCRIPTOR.fields_by_name[name]
    if field.enum_type is not None:
        setattr(msg, name, enum_number(field.enum_type, value))
        if field.name + LEGACY_SUFFIX in msg.DESCRIPTOR.fields_by_name:
            setattr(msg, name + LEGACY_SUFFIX, value)
    elif field.is_repeated:
        getattr(msg, name).extend(value)
    elif value is not None:
        setattr(msg, name, value)


def option_holder(spec: pb.SpecParams, option: str) -> tuple[object, str]:
    """The message holding a flat speculation option, and its path under `spec`: tree options live in `tree`."""
    if option in pb.SpecParams.DESCRIPTOR.fields_by_name:
        return spec, option
    return spec.tree, f"tree.{option}"


def spec_from_proto(msg: pb.SpecParams, defaults: SpecParams, prefix: str = "spec") -> SpecParams:
    """The request's speculation: what it sets over the server's defaults; InvalidRequestError names the proto field
    (spec.tree.depth)."""
    options = {}
    for option in SPEC_OPTIONS:
        holder, path = option_holder(msg, option)
        options[option] = read_field(holder, option, f"{prefix}.{path}")
    return spec_with(defaults, options, name_of=lambda option: f"{prefix}.{option_holder(msg, option)[1]}"
                     if option in SPEC_OPTIONS else f"{prefix}.{option}")


def spec_to_proto(spec: SpecParams) -> pb.SpecParams:
    msg = pb.SpecParams()
    for option, value in spec_options(spec).items():
        holder, _ = option_holder(msg, option)
        write_field(holder, option, value)
    return msg


def sampling_from_proto(msg: pb.SamplingParams, prefix: str = "sampling") -> SamplingParams:
    values = {name: value for name in SamplingParams.model_fields
              if (value := read_field(msg, name, f"{prefix}.{name}")) is not None}
    try:
        return validated(SamplingParams, **values)
    except InvalidRequestError as e:
        raise InvalidRequestError(f"{prefix}.{e.field}", e.message) from None


def sampling_to_proto(sampling: SamplingParams, stop: tuple[str, ...] = ()) -> pb.SamplingParams:
    msg = pb.SamplingParams(stop=list(stop))
    for name, value in sampling.model_dump().items():
        write_field(msg, name, value)
    return msg
