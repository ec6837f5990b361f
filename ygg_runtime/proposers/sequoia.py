"""`sequoia`: one static tree for every step, the E[A]-optimal shape for the measured per-rank
acceptance and cost (Sequoia; built at compile time by `ygg_compile.sequoia_tree` and stored in the plan).

Node v of the static tree is the drafter's rank-`ranks[v]` candidate under its parent. The drafter
runs once per level over that level's inner nodes, padded to a compiled width; leaves are never fed.
Children are chosen by rank, so the deterministic acceptance rule keeps sampling lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ygg_runtime.errors import YggError
from ygg_runtime.objective import StepShape
from ygg_runtime.proposers.base import DraftProposer, Drafter, StepState
from ygg_runtime.proposers.base import Params as BaseParams
from ygg_runtime.runner import WIDTHS, fit_width
from ygg_runtime.tree import TokenTree


@dataclass(frozen=True)
class SequoiaParams(BaseParams):
    parents: list[int] = field(default_factory=lambda: [-1])  # the static tree (node 0 the root)
    ranks: list[int] = field(default_factory=lambda: [0])  # node v: the drafter's rank-ranks[v] child of its parent
    widths: list[int] = field(default_factory=lambda: list(WIDTHS))  # the drafter's and target's compiled widths

    def __post_init__(self):
        parents, ranks = list(self.parents), list(self.ranks)
        if not parents or parents[0] != -1 or len(ranks) != len(parents) or any(
            not 0 <= p < v for v, p in enumerate(parents) if v
        ):
            raise YggError("sequoia needs a static tree: parents[0] == -1 and every other parent earlier in the list")
        if not self.widths or min(self.widths) < 1:
            raise YggError("sequoia needs compiled widths >= 1")

    def children(self) -> list[list[int]]:
        """Each node's children, in the order the acceptance walk tries them (rank 0 first)."""
        kids: list[list[int]] = [[] for _ in self.parents]
        for v in range(1, len(self.parents)):
            kids[self.parents[v]].append(v)
        return [sorted(k, key=lambda v: self.ranks[v]) for k in kids]

    def levels(self) -> list[list[int]]:
        """The inner nodes (those with children) of each depth: one drafter forward each."""
        depth = [0] * len(self.parents)
        for v in range(1, len(self.parents)):
            depth[v] = depth[self.parents[v]] + 1
        kids = self.children()
        return [[v for v in range(len(self.parents)) if depth[v] == d and kids[v]] for d in range(max(depth))]

    def step_shape(self) -> StepShape:
        levels = self.levels()
        if not levels:
            return StepShape((), 1)
        widths = sorted(self.widths)
        inner = tuple(fit_width(len(lv), widths) for lv in levels[1:])
        return StepShape((DraftProposer.BEGIN_WIDTH,) + inner, fit_width(len(self.parents), widths))


class Sequoia(DraftProposer):
    name = "sequoia"
    Params = SequoiaParams

    def __init__(self, params: SequoiaParams, drafter: Drafter | None):
        super().__init__(params, drafter)
        self.ranks, self.widths = list(params.ranks), tuple(sorted(params.widths))
        self.children, self.levels = params.children(), params.levels()
        self.verify_width = fit_width(len(params.parents), self.widths)

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
        node_of = {0: 0}  # static node -> tree node
        for d, level in enumerate(self.levels):
            if d == 0:
                logits = self.drafter.begin(seq)[None]
            else:
                nodes = [node_of[v] for v in level]
                logits = self.drafter.expand(tree, nodes, fit_width(len(nodes), self.widths))
            for v, row in zip(level, logits):
                kids = self.children[v]
                top = torch.softmax(row.float(), dim=-1).topk(max(self.ranks[c] for c in kids) + 1)
                for c in kids:
                    r = self.ranks[c]
                    node_of[c] = tree.add(node_of[v], top.indices[r].item(), top.values[r].item())
        tree.verify_width = self.verify_width
        return tree
