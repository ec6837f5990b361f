"""Mappings (a parsed plan.yaml, a method's parameters) built into typed dataclasses, each value
checked against its annotation: what makes the plan typed all the way down. Light (no torch): the
command line reads plans before it imports torch."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

from ygg_runtime.errors import YggError

RECOMPILE = ": recompile with `ygg compile`"  # what fixes a plan a field of which is wrong


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A dataclass's resolved annotations: resolving them evaluates every one (~1 ms a class), and
    each request's method parameters are built anew."""
    return typing.get_type_hints(cls)


def build(tp: Any, value: Any, where: str, path: str = "", advice: str = RECOMPILE) -> Any:
    """`value` checked against the annotation `tp` and built into it (dataclasses recursively);
    a value of the wrong kind or a missing field is refused in one line that names where it is
    (`where`: the file, `path`: the field) and what to do (`advice`). Keys a dataclass does not
    declare are ignored: a plan of this format written by an older build may carry a field since
    dropped."""
    if tp is Any:  # a diagnostic record kept as it is
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (tp,) = [a for a in args if a is not type(None)]
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            bad(where, path, "a mapping", value, advice)
        hints = _hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            sub = f"{path}.{f.name}" if path else f.name
            if f.name not in value:
                if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                    continue
                raise YggError(f"{where} lacks `{sub}`{advice}")
            kwargs[f.name] = build(hints[f.name], value[f.name], where, sub, advice)
        return tp(**kwargs)
    if tp is dict or origin is dict:  # a bare dict is kept as it is
        if not isinstance(value, dict):
            bad(where, path, "a mapping", value, advice)
        if not args:
            return value
        return {build(args[0], k, where, f"{path}.{k}", advice): build(args[1], v, where, f"{path}.{k}", advice)
                for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            bad(where, path, "a list", value, advice)
        return [build(args[0], v, where, f"{path}[{i}]", advice) for i, v in enumerate(value)]
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            bad(where, path, "a number", value, advice)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            bad(where, path, "an integer", value, advice)
        return value
    if tp in (str, bool):
        if not isinstance(value, tp):
            bad(where, path, f"a {tp.__name__}", value, advice)
        return value
    raise TypeError(f"plan field {path} has an annotation {tp!r} the reader does not know")


def bad(where: str, path: str, kind: str, value: Any, advice: str = RECOMPILE) -> typing.NoReturn:
    raise YggError(f"{where}: `{path}` should be {kind}, not {type(value).__name__}{advice}")


def plain(value: Any) -> Any:
    """`value` as plain mappings and lists (what YAML and JSON hold): dataclasses recursively, a
    field left at a default of None left out (the plan's file names only what was set)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not (getattr(value, f.name) is None and f.default is None)}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
