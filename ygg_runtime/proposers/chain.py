"""`chain`: draft k tokens one by one, verify them in one target forward (Leviathan / Chen)."""

from __future__ import annotations

from dataclasses import dataclass

from ygg_runtime.errors import YggError
from ygg_runtime.objective import StepShape
from ygg_runtime.proposers.base import DraftProposer, StepState, pick_children
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

    @property
    def max_tree_size(self) -> int:
        return self.params.k + 1

    def propose(self, state: StepState) -> TokenTree:
        tree = TokenTree(state.seq[-1], child_rule="iid")
        logits, node = self.drafter.begin(state.seq), 0
        k = self.params.k
        for d in range(k):
            (node,) = pick_children(tree, node, logits, 1, state.sampling)
            if d + 1 < k:
                logits = self.drafter.expand(tree, [node])[0]
        return tree
