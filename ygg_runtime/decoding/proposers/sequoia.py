"""`sequoia`: one static tree for every step, the E[A]-optimal shape for the measured per-rank
acceptance and cost (Sequoia; built at compile time by `ygg_compile.sequoia_tree` and stored in the plan).

Node v of the static tree is the drafter's rank-`ranks[v]` candidate under its parent. The drafter
runs once per level over that level's inner nodes, padded to a compiled width; leaves are never fed.
Children are chosen by rank, so the deterministic acceptance rule keeps rejection sampling lossless;
coupled sampling ranks the drafter's guesses under the position's noise (`ygg_runtime.decoding.coupling`).
"""

from __future__ import annotations

from ygg_runtime.schema.params import SequoiaParams, fit_width
from ygg_runtime.decoding.proposers.base import DraftProposer, Drafter, StaticTree, StepState
from ygg_runtime.decoding.tree import TokenTree


class Sequoia(DraftProposer):
    name = "sequoia"
    Params = SequoiaParams

    def __init__(self, params: SequoiaParams, drafter: Drafter | None):
        super().__init__(params, drafter)
        self.ranks, self.widths = list(params.ranks), tuple(sorted(params.widths))
        self.children, self.levels = params.children(), params.levels()
        self.verify_width = fit_width(len(params.parents), self.widths)
        self.shape = StaticTree(list(params.parents), self.ranks)

    @property
    def max_tree_size(self) -> int:
        return self.verify_width + max((fit_width(len(lv), self.widths) for lv in self.levels), default=0)

    def start(self, prompt: list[int]) -> None:
        if self.levels:
            super().start(prompt)

    def propose(self, state: StepState) -> TokenTree:
        seq = state.seq
        tree = TokenTree(seq[-1], child_rule="deterministic")
        if not self.levels:
            return tree
        if state.sampling is None:  # greedy: drafted on the device
            tree = self.shape.draft(self.drafter, seq, "deterministic", self.widths)
            tree.verify_width = self.verify_width
            return tree
        node_of = {0: 0}  # static node -> tree node
        for d, level in enumerate(self.levels):
            if d == 0:
                logits = self.drafter.begin(seq)
            else:
                nodes = [node_of[v] for v in level]
                logits = self.drafter.expand(tree, nodes, fit_width(len(nodes), self.widths))
            deepest = max(self.ranks[c] for v in level for c in self.children[v]) + 1
            for v, (values, tokens) in zip(level, state.top(logits, [d] * len(level), deepest)):
                for c in self.children[v]:
                    r = self.ranks[c]
                    node_of[c] = tree.add(node_of[v], tokens[r], values[r])
        tree.verify_width = self.verify_width
        return tree
