"""`specinfer`: a static k-ary tree, `width` children at every node down to `depth` (SpecInfer).

The drafter runs once per level over all of that level's nodes; the leaves are never fed.
"""

from ygg_runtime.accept import Verdict
from ygg_runtime.proposers.base import Drafter, Proposer, Sampling, pick_children
from ygg_runtime.tree import TokenTree


class SpecInfer(Proposer):
    name = "specinfer"

    def __init__(self, drafter: Drafter, width: int = 2, depth: int = 3):
        if width < 1 or depth < 1:
            raise ValueError("specinfer needs width >= 1 and depth >= 1")
        self.drafter, self.width, self.depth = drafter, width, depth
        self.max_tree_size = sum(width**d for d in range(depth + 1))

    def reset(self) -> None:
        self.drafter.reset()

    def prefill(self, tokens: list[int]) -> None:
        self.drafter.prefill(tokens)

    def propose(self, seq: list[int], sampling: Sampling | None) -> TokenTree:
        tree = TokenTree(seq[-1], child_rule="without_replacement")
        frontier, logits = [0], self.drafter.begin(seq)[None]
        for d in range(self.depth):
            level = [c for node, row in zip(frontier, logits) for c in pick_children(tree, node, row, self.width, sampling)]
            if d + 1 < self.depth:
                logits = self.drafter.expand(tree, level)
            frontier = level
        return tree

    def update(self, tree: TokenTree, verdict: Verdict) -> None:
        self.drafter.finish(verdict)
