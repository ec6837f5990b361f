"""`sequoia`: one static tree for every step, the E[A]-optimal shape for the measured per-rank
acceptance and cost (Sequoia; built at compile time by `ygg_compile.sequoia` and stored in the plan).

Node v of the static tree is the drafter's rank-`ranks[v]` candidate under its parent. The drafter
runs once per level over that level's inner nodes, padded to a compiled width; leaves are never fed.
Children are chosen by rank, so the deterministic acceptance rule keeps sampling lossless.
"""

from __future__ import annotations

import torch

from ygg_runtime.errors import YggError
from ygg_runtime.objective import StepShape
from ygg_runtime.proposers.base import DraftProposer, Drafter, Sampling
from ygg_runtime.runner import fit_width
from ygg_runtime.tree import TokenTree


class Sequoia(DraftProposer):
    name = "sequoia"

    def __init__(
        self,
        drafter: Drafter | None,
        parents: list[int] = (-1,),
        ranks: list[int] = (0,),
        widths: list[int] | tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
    ):
        parents, ranks = list(parents), list(ranks)
        if not parents or parents[0] != -1 or len(ranks) != len(parents) or any(
            not 0 <= p < v for v, p in enumerate(parents) if v
        ):
            raise YggError("sequoia needs a static tree: parents[0] == -1 and every other parent earlier in the list")
        super().__init__(drafter)
        self.parents, self.ranks, self.widths = parents, ranks, tuple(sorted(widths))
        depth = [0] * len(parents)
        self.children: list[list[int]] = [[] for _ in parents]
        for v in range(1, len(parents)):
            depth[v] = depth[parents[v]] + 1
            self.children[parents[v]].append(v)
        for kids in self.children:
            kids.sort(key=lambda v: ranks[v])  # the acceptance walk tries rank 0 first
        self.levels = [[v for v in range(len(parents)) if depth[v] == d and self.children[v]] for d in range(max(depth))]
        self.verify_width = fit_width(len(parents), self.widths)
        self.max_tree_size = self.verify_width + max((fit_width(len(lv), self.widths) for lv in self.levels), default=0)

    def prefill(self, tokens: list[int]) -> None:
        if self.levels:
            super().prefill(tokens)

    def propose(self, seq: list[int], sampling: Sampling | None) -> TokenTree:
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

    def step_shape(self) -> StepShape:
        if not self.levels:
            return StepShape((), 1)
        inner = tuple(fit_width(len(lv), self.widths) for lv in self.levels[1:])
        return StepShape((self.BEGIN_WIDTH,) + inner, self.verify_width)
