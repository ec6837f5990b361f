"""`specinfer`: a static k-ary tree, `width` children at every node down to `depth` (SpecInfer).

The drafter runs once per level over all of that level's nodes; the leaves are never fed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ygg_runtime.errors import YggError
from ygg_runtime.objective import StepShape
from ygg_runtime.proposers.base import DraftProposer, StepState, pick_children
from ygg_runtime.proposers.base import Params as BaseParams
from ygg_runtime.tree import TokenTree


@dataclass(frozen=True)
class SpecInferParams(BaseParams):
    width: int = 2  # children per node
    depth: int = 3

    def __post_init__(self):
        if not all(isinstance(v, int) for v in (self.width, self.depth)) or self.width < 1 or self.depth < 1:
            raise YggError("specinfer needs width >= 1 and depth >= 1")

    @property
    def nodes(self) -> int:
        return sum(self.width**d for d in range(self.depth + 1))

    def step_shape(self) -> StepShape:
        levels = tuple(self.width**d for d in range(1, self.depth))
        return StepShape((DraftProposer.BEGIN_WIDTH,) + levels, self.nodes)


class SpecInfer(DraftProposer):
    name = "specinfer"
    Params = SpecInferParams

    @property
    def max_tree_size(self) -> int:
        return self.params.nodes

    def propose(self, state: StepState) -> TokenTree:
        tree = TokenTree(state.seq[-1], child_rule="without_replacement")
        width, depth = self.params.width, self.params.depth
        frontier, logits = [0], self.drafter.begin(state.seq)[None]
        for d in range(depth):
            level = [c for node, row in zip(frontier, logits)
                     for c in pick_children(tree, node, row, width, state.sampling)]
            if d + 1 < depth:
                logits = self.drafter.expand(tree, level)
            frontier = level
        return tree
