"""`egt`: the Equal-Growth Tree (DESIGN.md §3), a tree that follows the context with static shapes.

Each step runs `depth` drafter forwards: the first feeds the new root (and the accepted leaf the
drafter never saw); each later one feeds exactly `draft_width` nodes, the unexpanded nodes with the
highest path value anywhere in the tree, and adds the top `top_k` children of each. A node's path
value is the estimated probability that its whole root path is accepted (draft probabilities through
the calibrated acceptance map). Verification pruning (`ygg_runtime.prune`) then takes the E[A]-best
root-connected subtree for every compiled verify width, and the objective picks the width with the
most tokens per modelled millisecond. Forwards narrower than their width are padded with masked
slots. Depth 0 is plain decoding: the drafter is never run.
"""

from __future__ import annotations

import heapq

import torch

from ygg_runtime import objective
from ygg_runtime.accept import Verdict
from ygg_runtime.errors import YggError
from ygg_runtime.objective import AcceptanceMap, Curves, StepShape
from ygg_runtime.proposers.base import DraftProposer, Drafter, Sampling, fit_width
from ygg_runtime.prune import Pruning
from ygg_runtime.tree import TokenTree


class EGT(DraftProposer):
    name = "egt"

    def __init__(
        self,
        drafter: Drafter | None,
        depth: int = 4,
        draft_width: int = 4,
        top_k: int = 8,
        verify_widths: list[int] | tuple[int, ...] = (1, 2, 4, 8, 16, 32),
        verify_width: int | None = None,
        accept: list[list[float]] | None = None,
        curves: Curves | None = None,
    ):
        if depth < 0 or draft_width < 1 or top_k < 1 or not verify_widths or min(verify_widths) < 1:
            raise YggError("egt needs depth >= 0, draft_width >= 1, top_k >= 1 and verify widths >= 1")
        super().__init__(drafter)
        self.depth, self.draft_width, self.top_k = depth, draft_width, top_k
        self.verify_widths = tuple(sorted(verify_widths))
        self.verify_width = verify_width or self.verify_widths[-1]  # the usual choice, for step_shape
        self.accept = AcceptanceMap(accept)
        self.curves = curves
        draft_slots = 1 + top_k * (1 + draft_width * max(0, depth - 1)) + draft_width
        self.max_tree_size = max(draft_slots, self.verify_widths[-1]) if depth else 1
        self.last_tree: TokenTree | None = None  # the whole drafted tree of the last step (calibration reads it)

    def prefill(self, tokens: list[int]) -> None:
        if self.depth:
            super().prefill(tokens)

    def propose(self, seq: list[int], sampling: Sampling | None) -> TokenTree:
        tree = TokenTree(seq[-1], child_rule="deterministic")
        self.last_tree = tree
        if self.depth == 0:
            return tree
        frontier: list[tuple[float, int]] = []  # (-path value, node): unexpanded nodes
        self._add_children(tree, 0, self.drafter.begin(seq), frontier)
        for _ in range(self.depth - 1):
            picks = [heapq.heappop(frontier)[1] for _ in range(min(self.draft_width, len(frontier)))]
            if not picks:
                break
            picks.sort()  # ascending node order keeps each row's ancestors before it
            logits = self.drafter.expand(tree, picks, self.draft_width)
            for node, row in zip(picks, logits):
                self._add_children(tree, node, row, frontier)
        return self._prune(tree, len(seq))

    def _add_children(self, tree: TokenTree, node: int, logits: torch.Tensor, frontier: list) -> None:
        top = torch.softmax(logits.float(), dim=-1).topk(min(self.top_k, logits.shape[-1]))
        for q, token in zip(top.values.tolist(), top.indices.tolist()):
            child = tree.add(node, token, q, self.accept(q))
            heapq.heappush(frontier, (-tree.path_values[child], child))

    def _prune(self, tree: TokenTree, context: int) -> TokenTree:
        """The verified subtree: for each compiled verify width its E[A]-best subtree, the width
        with the most tokens per modelled ms (all drafting of the step counted) chosen."""
        widest = self.verify_widths[-1]
        # Path values never increase along a path, so the best subtrees lie among the `widest`
        # highest-valued nodes and their ancestors: the knapsack runs on those only.
        keep = set(sorted(range(len(tree)), key=lambda v: -tree.path_values[v])[:widest])
        for v in list(keep):
            while v > 0 and tree.parents[v] not in keep:
                v = tree.parents[v]
                keep.add(v)
        nodes = sorted(keep | {0})
        index = {v: i for i, v in enumerate(nodes)}
        pruning = Pruning([index.get(tree.parents[v], -1) for v in nodes], [tree.path_values[v] for v in nodes], widest)
        width = self.verify_widths[-1]
        if self.curves is not None:
            drafting = self.curves.t_draft(self.BEGIN_WIDTH, context) + (self.depth - 1) * self.curves.t_draft(
                self.draft_width, context
            )

            def rate(w: int) -> float:
                return pruning.value(w) / (drafting + self.curves.t_verify(w, context) + self.curves.t_other(w))

            width = max(self.verify_widths, key=rate)
        sub = tree.subtree([nodes[i] for i in pruning.nodes(width)])
        sub.verify_width = fit_width(len(sub), self.verify_widths)
        return sub

    def update(self, tree: TokenTree, verdict: Verdict) -> None:
        if self.depth:
            origin = tree.origin or list(range(len(tree)))
            self.drafter.finish(Verdict([origin[v] for v in verdict.path], verdict.bonus))

    def step_shape(self) -> StepShape:
        if self.depth == 0:
            return StepShape((), 1)
        return StepShape((self.BEGIN_WIDTH,) + (self.draft_width,) * (self.depth - 1), self.verify_width)
