"""Every decoding method is one proposer; this is the table the runtime builds them from."""

from __future__ import annotations

from ygg_runtime.schema import params as method_params
from ygg_runtime.decoding.objective import Curves
from ygg_runtime.options import METHOD_NAMES
from ygg_runtime.schema.params import Params
from ygg_runtime.decoding.predictor import DepthPredictor
from ygg_runtime.decoding.proposers.ar import AR
from ygg_runtime.decoding.proposers.base import DraftProposer, Drafter, Hook, Proposer, Sampling, StepInfo, StepState
from ygg_runtime.decoding.proposers.chain import Chain
from ygg_runtime.decoding.proposers.egt import EGT
from ygg_runtime.decoding.proposers.pld import PLD
from ygg_runtime.decoding.retrieval import AdjacencyTable
from ygg_runtime.decoding.proposers.sequoia import Sequoia
from ygg_runtime.decoding.proposers.specinfer import SpecInfer

METHODS: dict[str, type[Proposer]] = {"ar": AR, "chain": Chain, "specinfer": SpecInfer, "sequoia": Sequoia, "egt": EGT,
                                      "pld": PLD}
# the names the command line shows and checks before it imports this module
assert tuple(METHODS) == METHOD_NAMES == tuple(method_params.PARAMS), "METHOD_NAMES, METHODS and PARAMS must agree"
assert all(METHODS[name].Params is method_params.PARAMS[name] for name in METHODS)
# The hand-set methods compile writes into every plan, at their own defaults unless the user sets
# them; sequoia's tree and egt's shape are planned at compile time (and both egt's and pld's
# retrieval values calibrated).
HAND_SET = ("ar", "chain", "specinfer", "pld")
DEFAULT_PARAMS = {name: METHODS[name].Params().to_dict() for name in HAND_SET}
params = method_params.parse  # a method's parameters from a mapping, checked


def build(name: str, values: dict | Params | None, drafter: Drafter | None = None, curves: Curves | None = None,
          predictor: DepthPredictor | None = None, adjacency: AdjacencyTable | None = None,
          hook: Hook | None = None) -> Proposer:
    """The proposer of a compiled method, built from what it uses of what the artifact has: a
    model-based one the drafter; egt and pld `curves` (the plan's profile, to pick verify widths)
    and `adjacency` (the seeded table they retrieve from); egt `predictor` (with the plan's depth
    policy, to pick its depth every step) and a compile-time `hook`."""
    p = params(name, values)
    if name == "ar":
        return AR(p)
    if name == "pld":
        return PLD(p, curves, adjacency)
    if name == "egt":
        return EGT(p, drafter, curves, predictor, adjacency, hook)
    return METHODS[name](p, drafter)  # chain, specinfer, sequoia: the drafter alone


def validate(methods: dict[str, dict | Params]) -> None:
    """Refuse unknown methods, parameters or values before anything is written."""
    for name, values in methods.items():
        params(name, values)


__all__ = ["METHODS", "DEFAULT_PARAMS", "DraftProposer", "Drafter", "Hook", "Params", "Proposer", "Sampling", "StepInfo", "StepState",
           "build", "params", "validate"]
