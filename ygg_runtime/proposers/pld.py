"""`pld`: retrieval only, no drafter — prompt lookup as a tree.

transformers' `prompt_lookup_num_tokens` copies one continuation after the first earlier match of
the last n tokens. Here every step verifies what `ygg_runtime.retrieval` finds: the continuations
of the longest earlier match, merged into a tree and counted, and the adjacency table's chain, each
node valued by compile's calibration, then pruned to the verify width with the most tokens per
modelled millisecond (the smallest, plain decoding, when nothing is worth verifying). It needs no
draft model, so it is in every artifact: a baseline for `egt`'s grafting, and the method for a
target without a drafter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ygg_runtime.errors import YggError
from ygg_runtime.objective import Curves, StepShape
from ygg_runtime.proposers.base import Params as BaseParams
from ygg_runtime.proposers.base import Proposer, StepInfo, StepState
from ygg_runtime.retrieval import AdjacencyTable, GraftParams, Retriever
from ygg_runtime.runner import WIDTHS
from ygg_runtime.tree import TokenTree


@dataclass(frozen=True)
class PLDParams(BaseParams):
    verify_widths: list[int] = field(default_factory=lambda: list(WIDTHS[:-1]))  # the target's compiled widths
    graft: dict = field(default_factory=dict)  # retrieval settings and calibrated values (`retrieval.GraftParams`)

    def __post_init__(self):
        if not self.verify_widths or min(self.verify_widths) < 1:
            raise YggError("pld needs verify widths >= 1")
        GraftParams.from_dict(self.graft)

    def step_shape(self) -> StepShape:
        return StepShape((), min(self.verify_widths))


class PLD(Proposer):
    name = "pld"
    Params = PLDParams

    def __init__(self, params: PLDParams, curves: Curves | None, adjacency: AdjacencyTable | None):
        super().__init__(params)
        self.retriever = Retriever(GraftParams.from_dict(params.graft), adjacency)
        self.curves = curves
        self.verify_widths = tuple(sorted(params.verify_widths))

    @property
    def max_tree_size(self) -> int:
        return 1 + self.retriever.params.budget

    def start(self, prompt: list[int]) -> None:
        self.retriever.reset(prompt)

    def propose(self, state: StepState) -> TokenTree:
        self.retriever.sync(state.seq)
        return self.retriever.alone(state.seq[-1], self.verify_widths, self.curves, len(state.seq))[1]

    def update(self, verdict) -> StepInfo:
        return StepInfo(retrieval_s=self.retriever.take_seconds())
