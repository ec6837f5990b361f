"""Every decoding method is one proposer module in this package: importing the package imports each
of them, and each proposer class registers itself under its method's name (`base.PROPOSERS`), as
its parameters register in the schema (`ygg_runtime.schema.params.PARAMS`). A new method is its
parameters and one module here; nothing lists it."""

from __future__ import annotations

import importlib
import pkgutil

from ygg_runtime.decoding.objective import Curves
from ygg_runtime.decoding.predictor import DepthPredictor
from ygg_runtime.decoding.proposers.base import (PROPOSERS, DraftProposer, Drafter, Hook, Parts, Proposer, Sampling,
                                                 StepInfo, StepState)
from ygg_runtime.decoding.retrieval import AdjacencyTable
from ygg_runtime.schema import params as method_params
from ygg_runtime.schema.params import Params

for _module in pkgutil.iter_modules(__path__):  # each method's module (and base): their classes register
    importlib.import_module(f"{__name__}.{_module.name}")

# Every method's proposer by its name (the registry itself: a module imported later registers too)
METHODS: dict[str, type[Proposer]] = PROPOSERS
params = method_params.parse  # a method's parameters from a mapping, checked


def default_params() -> dict[str, dict]:
    """What compile writes into every plan at their defaults unless the user sets them
    (`Params.hand_set`); sequoia's tree and egt's shape are planned at compile time (and both egt's
    and pld's retrieval values calibrated)."""
    return {name: cls().to_dict() for name, cls in method_params.PARAMS.items() if cls.hand_set}


def build(name: str, values: dict | Params | None, drafter: Drafter | None = None, curves: Curves | None = None,
          predictor: DepthPredictor | None = None, adjacency: AdjacencyTable | None = None,
          hook: Hook | None = None) -> Proposer:
    """The proposer of a compiled method, built from what it uses of what the artifact has
    (`Proposer.build`): a model-based one the drafter; egt and pld `curves` (the plan's profile, to
    pick verify widths) and `adjacency` (the seeded table they retrieve from); egt `predictor` (with
    the plan's depth policy, to pick its depth every step) and a compile-time `hook`."""
    p = params(name, values)
    if name not in METHODS:
        raise ValueError(f"method {name} has parameters but no proposer module")
    return METHODS[name].build(p, Parts(drafter, curves, predictor, adjacency, hook))


def validate(methods: dict[str, dict | Params]) -> None:
    """Refuse unknown methods, parameters or values before anything is written."""
    for name, values in methods.items():
        params(name, values)


__all__ = ["METHODS", "default_params", "DraftProposer", "Drafter", "Hook", "Params", "Parts", "Proposer", "Sampling",
           "StepInfo", "StepState", "build", "params", "validate"]
