"""`chain`: draft k tokens one by one, verify them in one target forward (Leviathan / Chen)."""

from __future__ import annotations

from ygg_runtime.schema.params import ChainParams
from ygg_runtime.decoding.proposers.base import DraftProposer, Drafter, StaticTree, StepState, pick_children
from ygg_runtime.decoding.tree import TokenTree


class Chain(DraftProposer):
    name = "chain"
    Params = ChainParams

    @property
    def max_tree_size(self) -> int:
        return self.params.k + 1

    def __init__(self, params: ChainParams, drafter: Drafter | None):
        super().__init__(params, drafter)
        self.shape = StaticTree(list(range(-1, params.k)), [0] * (params.k + 1))  # greedy: drafted on the device

    def propose(self, state: StepState) -> TokenTree:
        if state.sampling is None:
            return self.shape.draft(self.drafter, state.seq, "iid")
        tree = TokenTree(state.seq[-1], child_rule="iid")
        logits, node = self.drafter.begin(state.seq), 0
        k = self.params.k
        for d in range(k):
            ((node,),) = pick_children(tree, [node], logits, 1, state)
            if d + 1 < k:
                logits = self.drafter.expand(tree, [node])
        return tree
