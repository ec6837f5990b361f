"""`specinfer`: a static k-ary tree, `width` children at every node down to `depth` (SpecInfer).

The drafter runs once per level over all of that level's nodes; the leaves are never fed.
"""

from __future__ import annotations

from ygg_runtime.schema.params import SpecInferParams
from ygg_runtime.decoding.proposers.base import DraftProposer, Drafter, StaticTree, StepState, pick_children
from ygg_runtime.decoding.tree import TokenTree


class SpecInfer(DraftProposer):
    name = "specinfer"
    Params = SpecInferParams

    @property
    def max_tree_size(self) -> int:
        return self.params.nodes

    def __init__(self, params: SpecInferParams, drafter: Drafter | None):
        super().__init__(params, drafter)
        parents, ranks, level = [-1], [0], [0]  # the k-ary tree, level by level
        for _ in range(params.depth):
            below = []
            for v in level:
                for r in range(params.width):
                    below.append(len(parents))
                    parents.append(v)
                    ranks.append(r)
            level = below
        self.shape = StaticTree(parents, ranks)

    def propose(self, state: StepState) -> TokenTree:
        if state.sampling is None:  # greedy: drafted on the device
            return self.shape.draft(self.drafter, state.seq, "without_replacement")
        tree = TokenTree(state.seq[-1], child_rule="without_replacement")
        width, depth = self.params.width, self.params.depth
        frontier, logits = [0], self.drafter.begin(state.seq)
        for d in range(depth):
            level = [c for kids in pick_children(tree, frontier, logits, width, state) for c in kids]
            if d + 1 < depth:
                logits = self.drafter.expand(tree, level)
            frontier = level
        return tree
