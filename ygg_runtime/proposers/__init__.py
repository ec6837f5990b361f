"""Every decoding method is one proposer; this is the table the runtime builds them from."""

from __future__ import annotations

from ygg_runtime.errors import YggError
from ygg_runtime.proposers.ar import AR
from ygg_runtime.proposers.base import Drafter, Proposer, Sampling
from ygg_runtime.proposers.chain import Chain
from ygg_runtime.proposers.specinfer import SpecInfer

METHODS = {"ar": AR, "chain": Chain, "specinfer": SpecInfer}
DEFAULT_PARAMS = {"ar": {}, "chain": {"k": 4}, "specinfer": {"width": 2, "depth": 3}}


def build(name: str, params: dict, drafter: Drafter | None) -> Proposer:
    cls = METHODS[name]
    if cls is AR:
        return AR()
    if drafter is None:
        raise YggError(f"method {name} needs a draft model")
    return cls(drafter, **params)


def unbound(name: str, params: dict) -> Proposer:
    """A proposer without its drafter: enough to check its parameters and read its step shape."""
    if name not in METHODS:
        raise YggError(f"unknown method '{name}' (choose from {', '.join(METHODS)})")
    cls = METHODS[name]
    return cls() if cls is AR else cls(None, **params)


def validate(methods: dict[str, dict]) -> None:
    """Refuse unknown methods or parameters before anything is written (constructors check values)."""
    for name, params in methods.items():
        unbound(name, params)


__all__ = ["METHODS", "DEFAULT_PARAMS", "Drafter", "Proposer", "Sampling", "build"]
