"""`pld`: retrieval only, no drafter — prompt lookup as a tree.

transformers' `prompt_lookup_num_tokens` copies one continuation after the first earlier match of
the last n tokens. Here every step verifies what `ygg_runtime.decoding.retrieval` finds: the continuations
of the longest earlier match, merged into a tree and counted, and the adjacency table's chain, each
node valued by compile's calibration, then pruned to the verify width with the most tokens per
modelled millisecond (the smallest, plain decoding, when nothing is worth verifying). It needs no
draft model, so it is in every artifact: a baseline for `egt`'s grafting, and the method for a
target without a drafter.
"""

from __future__ import annotations

from ygg_runtime.decoding.objective import Curves
from ygg_runtime.schema.params import PLDParams
from ygg_runtime.decoding.proposers.base import Parts, Proposer, StepInfo, StepState
from ygg_runtime.decoding.retrieval import AdjacencyTable, Retriever
from ygg_runtime.decoding.tree import TokenTree


class PLD(Proposer):
    name = "pld"
    Params = PLDParams

    @classmethod
    def build(cls, params: PLDParams, parts: Parts) -> "PLD":
        return cls(params, parts.curves, parts.adjacency)

    def __init__(self, params: PLDParams, curves: Curves | None, adjacency: AdjacencyTable | None):
        super().__init__(params)
        self.retriever = Retriever(params.graft, adjacency)
        self.curves = curves
        self.verify_widths = tuple(sorted(params.verify_widths))

    @property
    def max_tree_size(self) -> int:
        return 1 + self.retriever.params.budget

    def start(self, prompt: list[int]) -> None:
        self.retriever.reset(prompt)

    def propose(self, state: StepState) -> TokenTree:
        self.retriever.sync(state.seq)
        return self.retriever.alone(state.seq[-1], self.verify_widths, self.curves, len(state.seq), state.estimate)[1]

    def update(self, verdict) -> StepInfo:
        return StepInfo(retrieval_s=self.retriever.take_seconds())
