"""Does a config value fit a dataclass field's type? One answer for every config fp4lab reads.

Recipes (TOML / JSON files, dotted overrides), training settings (``--config``, ``--set``) and
model overrides are checked at the door against their dataclass's field types, so that an error
names the key and the type instead of surfacing deep inside a run ("'<' not supported between
'str' and 'int'"). Values are as TOML, JSON and ``--set`` give them: a float field takes an int,
an int field never a bool or a float, an enum (``Choice``) field its name, a tuple field a list,
a nested dataclass field a table.

Public: ``fits``, ``type_name``, ``field_types``.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

from .formats.types import Choice


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """A dataclass's field name -> its resolved type hint."""
    return typing.get_type_hints(cls)


def fits(value: Any, hint: Any) -> bool | None:
    """Whether ``value`` can stand for a field typed ``hint``; None where this module does not
    judge that kind of hint (the dataclass's own checks then decide)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        verdicts = [fits(value, a) for a in args]
        return True if True in verdicts else (None if None in verdicts else False)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return False
        items = args[:1] * len(value) if len(args) == 2 and args[1] is Ellipsis else args
        if len(items) != len(value):
            return None  # a list of the wrong length: the dataclass says what it expects
        return all(fits(v, a) is not False for v, a in zip(value, items))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (str, bool, dict, list):
        return isinstance(value, hint)
    if isinstance(hint, type) and issubclass(hint, Choice):
        return isinstance(value, str)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return isinstance(value, (dict, hint))
    return None


def type_name(hint: Any) -> str:
    """How an error message says ``hint``: "int", "float or none", "a list of float",
    "one of 'rtne', 'stochastic'"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        return f"a list of {type_name(args[0])}"
    if args:
        return " or ".join(type_name(a) for a in args)
    if isinstance(hint, type) and issubclass(hint, Choice):
        return "one of " + ", ".join(repr(m.value) for m in hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return f"a {hint.__name__} table"
    return "none" if hint is type(None) else getattr(hint, "__name__", str(hint))
