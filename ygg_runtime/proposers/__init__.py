"""Every decoding method is one proposer; this is the table the runtime builds them from."""

from __future__ import annotations

from ygg_runtime.errors import YggError
from ygg_runtime.proposers.ar import AR
from ygg_runtime.proposers.base import Drafter, Proposer, Sampling
from ygg_runtime.objective import Curves
from ygg_runtime.predictor import DepthPredictor
from ygg_runtime.proposers.chain import Chain
from ygg_runtime.proposers.egt import EGT
from ygg_runtime.proposers.sequoia import Sequoia
from ygg_runtime.proposers.specinfer import SpecInfer

METHODS = {"ar": AR, "chain": Chain, "specinfer": SpecInfer, "sequoia": Sequoia, "egt": EGT}
# Parameters of the hand-set methods; sequoia's tree and egt's shape are planned at compile time.
DEFAULT_PARAMS = {"ar": {}, "chain": {"k": 4}, "specinfer": {"width": 2, "depth": 3}}


def build(name: str, params: dict, drafter: Drafter | None, curves: Curves | None = None,
          predictor: DepthPredictor | None = None) -> Proposer:
    """The proposer of a compiled method; `curves` (the plan's profile) lets egt pick verify widths,
    and with `predictor` (and the plan's depth policy) its depth."""
    cls = METHODS[name]
    if cls is AR:
        return AR()
    if drafter is None:
        raise YggError(f"method {name} needs a draft model")
    if cls is EGT:
        return EGT(drafter, **params, curves=curves, predictor=predictor)
    return cls(drafter, **params)


def unbound(name: str, params: dict) -> Proposer:
    """A proposer without its drafter: enough to check its parameters and read its step shape."""
    if name not in METHODS:
        raise YggError(f"unknown method '{name}' (choose from {', '.join(METHODS)})")
    cls = METHODS[name]
    try:
        return cls() if cls is AR else cls(None, **params)
    except TypeError as e:
        raise YggError(f"method {name}: {e}") from e


def validate(methods: dict[str, dict]) -> None:
    """Refuse unknown methods or parameters before anything is written (constructors check values)."""
    for name, params in methods.items():
        unbound(name, params)


__all__ = ["METHODS", "DEFAULT_PARAMS", "Drafter", "Proposer", "Sampling", "build"]
