"""One way to read a service's settings (ServiceConfig.settings) into its settings dataclass.

Every service declares a dataclass (validated in its __post_init__) and calls `parse_settings`. An
unknown key is an error naming the service and the key, so a typo never silently falls back to a
default; a value of the wrong type is an error naming the key. A field may gather keys given flat
in the same mapping: `flat_field()` builds a nested dataclass from its own fields' keys (e.g. the
prefill router's routing policy), `flat_keys(keys)` collects the listed keys into a dict (e.g. the
engine options a worker passes on, each checked with the engine's type).
"""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Mapping, TypeVar

T = TypeVar("T")
_SCALARS = (bool, int, float, str)


def flat_field(default_factory):
    """A nested settings dataclass whose fields are given at the top level of the mapping."""
    return dataclasses.field(default_factory=default_factory, metadata={"flat": "dataclass"})


def flat_keys(keys: Mapping[str, type] | tuple[str, ...]):
    """A dict of the listed keys, given at the top level of the mapping; where `keys` maps each to a
    type, its value is checked as a field of that type is."""
    types = dict(keys) if isinstance(keys, Mapping) else dict.fromkeys(keys)
    return dataclasses.field(default_factory=dict, metadata={"flat": "keys", "keys": types})


def known_keys(cls: type) -> set[str]:
    hints = typing.get_type_hints(cls)
    keys: set[str] = set()
    for f in dataclasses.fields(cls):
        flat = f.metadata.get("flat")
        if flat == "dataclass":
            keys |= known_keys(hints[f.name])
        elif flat == "keys":
            keys |= set(f.metadata["keys"])
        else:
            keys.add(f.name)
    return keys


def parse_settings(cls: type[T], values: Mapping[str, Any] | None, service: str) -> T:
    """`cls` built from `values`; ValueError naming `service` and the key for anything wrong."""
    values = dict(values or {})
    unknown = sorted(set(values) - known_keys(cls))
    if unknown:
        raise ValueError(f"{service}: unknown setting{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(repr(k) for k in unknown)} (known: {', '.join(sorted(known_keys(cls)))})")
    return _build(cls, values, service)


def _build(cls: type[T], values: dict[str, Any], service: str) -> T:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        flat = f.metadata.get("flat")
        if flat == "dataclass":
            kwargs[f.name] = _build(hints[f.name], values, service)
        elif flat == "keys":
            types = f.metadata["keys"]
            kwargs[f.name] = {k: values[k] if types[k] is None else _typed(values[k], types[k], service, k)
                              for k in types if k in values}
        elif f.name in values:
            kwargs[f.name] = _typed(values[f.name], hints[f.name], service, f.name)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{service} settings: {exc}") from None


def _typed(value: Any, hint: Any, service: str, key: str) -> Any:
    """Check scalars (ints are fine where a float is expected; a bool is no number); lists become
    tuples where the field is a tuple. Other types are left to the dataclass's own checks."""
    if hint in _SCALARS:
        ok = isinstance(value, hint) and not (hint is not bool and isinstance(value, bool))
        if hint is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok or (hint is float and not math.isfinite(value)):
            raise ValueError(f"{service}: setting {key!r} must be a finite {hint.__name__}, got {value!r}")
        return value
    if typing.get_origin(hint) is tuple and isinstance(value, list):
        return tuple(value)
    return value


def require_positive(settings, *names: str) -> None:
    """For a settings dataclass's __post_init__: each named field is a positive finite number."""
    for name in names:
        value = getattr(settings, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
