"""Typed config trees from YAML and dotted command-line overrides.

A recipe is a YAML mapping mirroring a tree of dataclasses. :func:`build` turns a plain mapping into
that tree, checking every key and value against the dataclass field types, so a typo or a wrong type
fails before anything starts, naming the full dotted path, the value and what was expected::

    cfg = build(RunConfig, merge(load_yaml("recipe.yaml"), parse_overrides(["rollout.n=8"])))

Each dataclass may validate itself in ``__post_init__`` (raising ``ValueError``); the message is
prefixed with the dotted path of the section that failed.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, Dict, List, Mapping, Sequence, Tuple, Type, TypeVar, Union

from megatron_rl import yaml_safe

T = TypeVar("T")


class ConfigError(ValueError):
    """A recipe or override does not fit the config tree. ``problems``: one line each (several are listed
    together, so a recipe is fixed in one round trip)."""

    def __init__(self, problems: Union[str, Sequence[str]]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            super().__init__(self.problems[0])
        else:
            super().__init__(f"{len(self.problems)} problems in the config:\n"
                             + "\n".join(f"  - {p}" for p in self.problems))


def load_yaml(path: Union[str, Path]) -> Dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"recipe {str(path)!r} does not exist (pass the path of a YAML file, e.g. examples/tiny_cpu.yaml)")
    if p.stat().st_size > 16 << 20:  # a recipe is a few KB; this is another file
        raise ConfigError(f"recipe {str(path)!r} has {p.stat().st_size} bytes: not a recipe (pass a YAML file)")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"recipe {str(path)!r} cannot be read ({type(e).__name__}: {e})") from None
    data = yaml_safe.load_bytes(raw, f"recipe {p}", ConfigError) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {p}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def parse_overrides(items: Sequence[str]) -> Dict[str, Any]:
    """``["a.b=1", "c=[1, 2]"]`` -> nested mapping; values are parsed as YAML scalars/lists."""
    out: Dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r}: expected dotted.key=value, e.g. rollout.n_samples_per_prompt=8")
        value = yaml_safe.load_bytes(raw.encode("utf-8", "surrogateescape"), f"override {yaml_safe.short(item)}",
                                     ConfigError) if raw != "" else ""
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r} conflicts with an earlier override of {part!r}")
            node = nxt
        node[parts[-1]] = value
    return out


def merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> Dict[str, Any]:
    """Recursive merge: mappings merge key by key, anything else in ``update`` replaces."""
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def build(cls: Type[T], data: Any, path: str = "") -> T:
    """Instantiate dataclass ``cls`` from a mapping, recursively, with type checks."""
    return _convert(cls, data, path or cls.__name__)


def to_dict(obj: Any) -> Any:
    """The plain (YAML-able) form of a config tree."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _describe(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin is Union:
        if value is None and type(None) in args:
            return None
        errors = []
        for alt in args:
            if alt is type(None):
                continue
            try:
                return _convert(alt, value, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}={value!r}: expected {_describe(tp)}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{path}={value!r}: expected one of {list(args)}")
        return value
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, value, path)
    if origin in (list, List, tuple, Tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}={value!r}: expected a list")
        if origin in (tuple, Tuple) and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{path}={value!r}: expected {len(args)} items")
            return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        items = [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin in (tuple, Tuple) or tp is tuple else items
    if origin in (dict, Dict) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}={value!r}: expected a mapping")
        if len(args) == 2 and dataclasses.is_dataclass(args[1]):  # e.g. named sections: build each one
            return {k: _convert(args[1], v, f"{path}.{k}") for k, v in value.items()}
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}={value!r}: expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}={value!r}: expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # YAML reads 1e-6 (no dot) as a string
            if isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
            raise ConfigError(f"{path}={value!r}: expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}={value!r}: expected a string")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{path}={value!r}: expected {_describe(tp)}")
    return value


def _build_dataclass(cls: Any, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(value) and isinstance(value, cls):
        return value
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: expected a mapping of {cls.__name__} fields, got {value!r}")
    normalize = getattr(cls, "normalize_keys", None)  # a section's table of renamed keys
    if normalize is not None:
        value = normalize(value)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    problems: List[str] = []
    kwargs = {}
    for k, v in value.items():  # every field is checked: all type errors are reported together
        if k not in fields:
            near = difflib.get_close_matches(str(k), list(fields), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            problems.append(f"{path}.{k}: unknown field{hint} ({cls.__name__} has: {', '.join(fields)})")
            continue
        try:
            kwargs[k] = _convert(hints[k], v, f"{path}.{k}")
        except ConfigError as e:
            problems += e.problems
    missing = [n for n, f in fields.items() if n not in value and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        problems.append(f"{path}: missing required field(s) {missing}")
    if problems:
        raise ConfigError(problems)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path}: {e}") from None
