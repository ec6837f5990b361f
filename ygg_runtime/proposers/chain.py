"""`chain`: draft k tokens one by one, verify them in one target forward (Leviathan / Chen)."""

from ygg_runtime.errors import YggError
from ygg_runtime.objective import StepShape
from ygg_runtime.proposers.base import DraftProposer, Drafter, Sampling, pick_children
from ygg_runtime.tree import TokenTree


class Chain(DraftProposer):
    name = "chain"

    def __init__(self, drafter: Drafter, k: int = 4):
        if k < 1:
            raise YggError("chain needs k >= 1")
        super().__init__(drafter)
        self.k = k
        self.max_tree_size = k + 1

    def propose(self, seq: list[int], sampling: Sampling | None) -> TokenTree:
        tree = TokenTree(seq[-1], child_rule="iid")
        logits, node = self.drafter.begin(seq), 0
        for d in range(self.k):
            (node,) = pick_children(tree, node, logits, 1, sampling)
            if d + 1 < self.k:
                logits = self.drafter.expand(tree, [node])[0]
        return tree

    def step_shape(self) -> StepShape:
        return StepShape((self.BEGIN_WIDTH,) + (1,) * (self.k - 1), self.k + 1)
