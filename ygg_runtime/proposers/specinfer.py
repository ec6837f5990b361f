"""`specinfer`: a static k-ary tree, `width` children at every node down to `depth` (SpecInfer).

The drafter runs once per level over all of that level's nodes; the leaves are never fed.
"""

from ygg_runtime.errors import YggError
from ygg_runtime.objective import StepShape
from ygg_runtime.proposers.base import DraftProposer, Drafter, Sampling, pick_children
from ygg_runtime.tree import TokenTree


class SpecInfer(DraftProposer):
    name = "specinfer"

    def __init__(self, drafter: Drafter, width: int = 2, depth: int = 3):
        if width < 1 or depth < 1:
            raise YggError("specinfer needs width >= 1 and depth >= 1")
        super().__init__(drafter)
        self.width, self.depth = width, depth
        self.max_tree_size = sum(width**d for d in range(depth + 1))

    def propose(self, seq: list[int], sampling: Sampling | None) -> TokenTree:
        tree = TokenTree(seq[-1], child_rule="without_replacement")
        frontier, logits = [0], self.drafter.begin(seq)[None]
        for d in range(self.depth):
            level = [c for node, row in zip(frontier, logits) for c in pick_children(tree, node, row, self.width, sampling)]
            if d + 1 < self.depth:
                logits = self.drafter.expand(tree, level)
            frontier = level
        return tree

    def step_shape(self) -> StepShape:
        levels = tuple(self.width**d for d in range(1, self.depth))
        return StepShape((self.BEGIN_WIDTH,) + levels, self.max_tree_size)
