"""How evospec.v1 names its closed sets, in one place for the SDK and the server: an enum's values are the strings
clients use, upper-cased, after a prefix from the enum's name (TreeShape.TREE_SHAPE_CHAIN = "chain"), 0 is
UNSPECIFIED, and the string field an enum replaced keeps its number as `<field>_name` (LEGACY_SUFFIX)."""
from __future__ import annotations

LEGACY_SUFFIX = "_name"


def enum_prefix(enum_type) -> str:
    """TreeShape -> TREE_SHAPE_"""
    return "".join(f"_{c}" if c.isupper() and i else c for i, c in enumerate(enum_type.name)).upper() + "_"


def enum_number(enum_type, value: str) -> int:
    """The number of a string; ValueError naming the choices for one the enum does not have."""
    prefix = enum_prefix(enum_type)
    found = enum_type.values_by_name.get(prefix + str(value).upper())
    if found is None or found.number == 0:
        names = [v.name[len(prefix):].lower() for v in enum_type.values if v.number]
        raise ValueError(f"must be one of {', '.join(names)}; got {value!r}")
    return found.number


def enum_string(enum_type, number: int) -> str | None:
    """The string of a number; None for UNSPECIFIED (0) or a number this build does not know."""
    value = enum_type.values_by_number.get(number)
    if number == 0 or value is None:
        return None
    return value.name[len(enum_prefix(enum_type)):].lower()
