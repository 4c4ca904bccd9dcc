"""The generic part of the configuration: how a field is declared, how a config file is read as
untrusted input, and one walker over the declarations that builds, checks and describes them.

:mod:`ftstate.core.config` declares the fields (:func:`config_field`); this module knows nothing of
which fields there are. It runs wherever a config is read: the driver (``RuntimeConfig.from_yaml``)
and the CLI (``ftstate config``, the generated docs/configuration.md).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from ftstate.core.errors import ConfigError
from ftstate.core.text import short_repr

#: Largest config file read (a real one is a few KiB).
MAX_CONFIG_BYTES = 1024 * 1024
#: Deepest nesting of mappings and lists accepted in a config file.
MAX_CONFIG_DEPTH = 32
#: Largest integer a config value may hold (int64).
_MAX_INT = (1 << 63) - 1

def load_yaml(text: str, source: str) -> Any:
    """``yaml.safe_load`` without aliases and with bounded nesting (ConfigError otherwise)."""
    import yaml

    class Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:  # type: ignore[override]
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                raise ConfigError("", f"{source}: YAML aliases are not accepted (line {mark.line + 1}); "
                                      "write the value out")
            self.depth += 1
            if self.depth > MAX_CONFIG_DEPTH:
                raise ConfigError("", f"{source}: nested deeper than {MAX_CONFIG_DEPTH} levels")
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    loader = Loader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def config_field(default: Any, doc: str, **rules: Any) -> Any:
    """A dataclass field carrying its documentation and validation rules.

    rules: ``ge``/``gt`` numeric lower bounds, ``env`` an environment override, ``choices``
    the values each element of a ``list[str]`` may take, ``keys`` the keys a ``dict`` may have.
    """
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=default, metadata={"doc": doc, **rules})
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: dict(default), metadata={"doc": doc, **rules})
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"doc": doc, **rules})
    return dataclasses.field(default=default, metadata={"doc": doc, **rules})


def hint_of(cls: type, dotted: str) -> Any:
    owner: type = cls
    parts = dotted.split(".")
    for part in parts[:-1]:
        owner = typing.get_type_hints(owner)[part]
    return typing.get_type_hints(owner)[parts[-1]]


def walk_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field[Any]]]:
    """Every leaf field of a config dataclass with its dotted path."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            yield from walk_fields(hints[f.name], f"{path}.")
        else:
            yield path, f


def describe(cls: type) -> list[dict[str, Any]]:
    """Every leaf field of config dataclass ``cls`` as ``{path, type, default, doc, env, bounds}``."""
    rows = []
    defaults = cls()
    for path, f in walk_fields(cls):
        value: Any = defaults
        for part in path.split("."):
            value = getattr(value, part)
        rows.append(
            {
                "path": path,
                "type": _type_name(hint_of(cls, path)),
                "default": value,
                "doc": f.metadata.get("doc", ""),
                "env": f.metadata.get("env"),
                "bounds": _bounds_text(f),
            }
        )
    return rows


def sections(cls: type) -> dict[str, str]:
    """Docs of the nested blocks of ``cls`` (``fault_tolerance`` …)."""
    hints = typing.get_type_hints(cls)
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}


def _bounds_text(f: dataclasses.Field[Any]) -> str:
    if "choices" in f.metadata:
        return "each one of " + ", ".join(f.metadata["choices"])
    if "keys" in f.metadata:
        return "keys: " + ", ".join(f.metadata["keys"])
    if "ge" in f.metadata:
        return f">= {f.metadata['ge']}"
    if "gt" in f.metadata:
        return f"> {f.metadata['gt']}"
    return ""


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(hint))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(_type_name(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if origin is list:
        return str(hint)
    return getattr(hint, "__name__", str(hint))


def build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(prefix.rstrip("."), f"expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    bad_keys = [k for k in data if not isinstance(k, str)]
    if bad_keys:
        raise ConfigError(prefix.rstrip("."), f"keys must be strings, got {short_repr(bad_keys[0])}")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{prefix}{short_repr(unknown[0])[1:-1]}",
            f"unknown key; expected one of: {', '.join(sorted(fields))}",
        )
    values = {}
    for name, value in data.items():
        hint = hints[name]
        path = f"{prefix}{name}"
        if dataclasses.is_dataclass(hint):
            values[name] = build(hint, {} if value is None else value, f"{path}.")
        else:
            values[name] = convert(fields[name], hint, value, path)
    return cls(**values)


def convert(f: dataclasses.Field[Any], hint: Any, value: Any, path: str, *, from_env: bool = False) -> Any:
    """Check one leaf value against its declared type and bounds; strings from the
    environment are parsed first."""
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if optional else hint
    if value is None:
        if optional:
            return None
        raise ConfigError(path, f"must not be null; expected {_type_name(hint)}")
    if typing.get_origin(base) is dict:
        return _convert_mapping(f, base, value, path)
    if typing.get_origin(base) is list:
        return _convert_list(f, value, path)
    if typing.get_origin(base) is Literal:
        choices = typing.get_args(base)
        if value not in choices:
            raise ConfigError(path, f"must be one of {', '.join(repr(c) for c in choices)}, got {short_repr(value)}")
        return value
    if base is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"must be true or false, got {short_repr(value)}")
        return value
    if base in (int, float):
        if from_env:
            try:
                value = base(value)
            except ValueError as exc:
                raise ConfigError(path, f"must be a number, got {short_repr(value)}") from exc
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"must be {'an integer' if base is int else 'a number'}, got {short_repr(value)}")
        if isinstance(value, float) and not math.isfinite(value):  # a bound must bound something
            raise ConfigError(path, f"must be a finite number, got {short_repr(value)}")
        if isinstance(value, int) and abs(value) > _MAX_INT:
            raise ConfigError(path, f"must be at most {_MAX_INT} in magnitude, got {short_repr(value)}")
        if base is int and not float(value).is_integer():
            raise ConfigError(path, f"must be an integer, got {short_repr(value)}")
        value = base(value)
        if "ge" in f.metadata and value < f.metadata["ge"]:
            raise ConfigError(path, f"must be >= {f.metadata['ge']}, got {value:g}")
        if "gt" in f.metadata and value <= f.metadata["gt"]:
            raise ConfigError(path, f"must be > {f.metadata['gt']}, got {value:g}")
        return value
    if base is str:
        if not isinstance(value, str) or not value:
            raise ConfigError(path, f"must be a non-empty string, got {short_repr(value)}")
        return value
    raise ConfigError(path, f"unsupported field type {hint!r}")  # pragma: no cover - declaration bug


def _convert_list(f: dataclasses.Field[Any], value: Any, path: str) -> list[str]:
    """A ``list[str]`` whose elements are among ``choices`` (the field's metadata), without
    repeats. ``auto`` stands alone: the string ``auto``, ``[auto]`` and ``[]`` all mean it."""
    choices: tuple[str, ...] = f.metadata.get("choices", ())
    if value == "auto" and "auto" in choices:
        return ["auto"]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(path, f"must be a list, got {short_repr(value)}")
    out: list[str] = []
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise ConfigError(f"{path}[{i}]", f"must be a non-empty string, got {short_repr(item)}")
        if choices and item not in choices:
            raise ConfigError(f"{path}[{i}]", f"must be one of {', '.join(repr(c) for c in choices)}, got {short_repr(item)}")
        if item in out:
            raise ConfigError(f"{path}[{i}]", f"{short_repr(item)} is named twice")
        out.append(item)
    if "auto" in choices:
        if not out:
            return ["auto"]
        if "auto" in out and len(out) > 1:
            raise ConfigError(path, f"'auto' cannot be combined with named sources, got {short_repr(out)}")
    return out


def _convert_mapping(f: dataclasses.Field[Any], hint: Any, value: Any, path: str) -> dict[str, Any]:
    """A ``dict[str, float]`` (resources: numbers >= 0) or ``dict[str, str]`` (labels,
    endpoints), with only the ``keys`` of the field's metadata when it names them."""
    _, value_type = typing.get_args(hint)
    if not isinstance(value, Mapping):
        raise ConfigError(path, f"must be a mapping of names to {value_type.__name__} values, got {short_repr(value)}")
    allowed: tuple[str, ...] = f.metadata.get("keys", ())
    out: dict[str, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(path, f"keys must be non-empty strings, got {short_repr(key)}")
        if allowed and key not in allowed:
            raise ConfigError(f"{path}.{short_repr(key)[1:-1]}", f"unknown key; expected one of: {', '.join(allowed)}")
        if value_type is float:
            if isinstance(item, bool) or not isinstance(item, (int, float)) or not math.isfinite(item) or item < 0:
                raise ConfigError(f"{path}.{key}", f"must be a number >= 0, got {short_repr(item)}")
            out[key] = float(item)
        elif not isinstance(item, str) or not item:
            raise ConfigError(f"{path}.{key}", f"must be a non-empty string, got {short_repr(item)}")
        else:
            out[key] = item
    return out
