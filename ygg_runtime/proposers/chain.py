"""`chain`: draft k tokens one by one, verify them in one target forward (Leviathan / Chen)."""

from __future__ import annotations

from dataclasses import dataclass

from ygg_runtime.errors import YggError
from ygg_runtime.objective import StepShape
from ygg_runtime.proposers.base import DraftProposer, Sampling, StepState, pick_children
from ygg_runtime.proposers.base import Params as BaseParams
from ygg_runtime.tree import TokenTree


@dataclass(frozen=True)
class ChainParams(BaseParams):
    k: int = 4  # drafted tokens per step

    def __post_init__(self):
        if not isinstance(self.k, int) or self.k < 1:
            raise YggError("chain needs k >= 1")

    def step_shape(self) -> StepShape:
        return StepShape((DraftProposer.BEGIN_WIDTH,) + (1,) * (self.k - 1), self.k + 1)


class Chain(DraftProposer):
    name = "chain"
    Params = ChainParams

    def __init__(self, params: ChainParams, drafter=None, curves=None, predictor=None, adjacency=None):
        super().__init__(params, drafter)
        self.max_tree_size = params.k + 1

    def propose(self, seq: list[int], state: StepState, sampling: Sampling | None) -> TokenTree:
        tree = TokenTree(seq[-1], child_rule="iid")
        logits, node = self.drafter.begin(seq), 0
        k = self.params.k
        for d in range(k):
            (node,) = pick_children(tree, node, logits, 1, sampling)
            if d + 1 < k:
                logits = self.drafter.expand(tree, [node])[0]
        return tree
