"""Verification pruning: the root-connected subtree of k nodes with the largest E[A].

E[A] of a verified tree = Σ over its nodes of the path value (the root's is 1), where a node's path
value is the probability that its whole root path is accepted. A node can only be verified with its
parent, so the best k-subtree is a tree knapsack: bottom-up, best[u][j] = the best sum of j nodes
in u's subtree that include u and stay connected to it; children are merged one at a time, every
table capped at min(subtree size, k), which keeps the whole DP at O(n·k).
"""

from __future__ import annotations

import itertools

from ygg_runtime.decoding.objective import Curves
from ygg_runtime.schema.params import StepShape
from ygg_runtime.schema.params import fit_width
from ygg_runtime.decoding.tree import TokenTree


def verified(tree: TokenTree, verify_widths: tuple[int, ...], curves: Curves | None, draft_widths: tuple[int, ...],
             context: int, draft_context: int | None = None) -> TokenTree:
    """The subtree to verify: for each compiled verify width its E[A]-best subtree, the width with
    the most tokens per modelled ms chosen (`draft_widths`: the step's drafter forwards, counted in
    its time, at `draft_context` when a window leaves the drafter's shorter); the widest without
    curves. Drafted and retrieved nodes compete on their path values alone, so retrieval fills
    exactly the slots pruning leaves free."""
    widest = verify_widths[-1]
    pruning = Pruning(tree.parents, tree.path_values, widest)
    width = widest
    if curves is not None:
        times = curves.costs(tuple(StepShape(draft_widths, w) for w in verify_widths)).at(context, draft_context)
        rates = [pruning.value(w) / ms for w, ms in zip(verify_widths, times)]
        width = verify_widths[rates.index(max(rates))]
    sub = tree.subtree(pruning.nodes(width))
    sub.verify_width = fit_width(len(sub), verify_widths)
    return sub


def allocate(trees: list[TokenTree], curves: Curves, context: int, draft_ms: float = 0.0, others: int = 0,
             max_rows: int = 64, sequences: int | None = None) -> list[TokenTree]:
    """CAST's allocation of one batched verify: the root-connected subtree of each tree (every
    root kept) whose nodes, max_rows at most in all, give the batch the most expected accepted
    tokens per modelled millisecond of its step — Σ E[A] / (draft_ms + f(B, c, N) + T_other(N)),
    N the nodes verified (plus `others`, rows of trees that cannot be cut) over B `sequences`
    (default: the trees), f the measured batched forward (`Curves.t_batch`). One knapsack over all
    trees: each tree's best value for every size (`Pruning`), combined across trees; the marginal
    cost of a node depends only on N, so the best N is read off the combined table. As the batch
    grows, a node's marginal millisecond buys less and every tree shrinks, down to its root:
    batched plain decoding."""
    tables = [Pruning(t.parents, t.path_values, min(len(t), max_rows)) for t in trees]
    # best[j]: the best Σ E[A] of j nodes over the trees so far; picks[i][j]: tree i's share of it
    best = [0.0]
    picks: list[list[int]] = []
    for table in tables:
        sizes = range(1, len(table.root))
        merged = [float("-inf")] * min(len(best) + len(table.root) - 1, max_rows + 1)
        take = [0] * len(merged)
        for a, value in enumerate(best):
            if value == float("-inf"):
                continue
            for b in sizes:
                if a + b < len(merged) and value + table.root[b] > merged[a + b]:
                    merged[a + b], take[a + b] = value + table.root[b], b
        best = merged
        picks.append(take)

    b = sequences or len(trees)

    def rate(n: int) -> float:
        rows = n + others
        return best[n] / (draft_ms + curves.t_batch("target", b, rows, context) + curves.t_other(rows))

    n = max((j for j in range(len(trees), len(best)) if best[j] > float("-inf")), key=rate)
    out: list[TokenTree] = [None] * len(trees)  # type: ignore[list-item]
    for i in range(len(trees) - 1, -1, -1):
        size = picks[i][n]
        nodes = tables[i].nodes(size)
        tree = trees[i]
        out[i] = tree.subtree(nodes)  # its origin maps into the tree given (the proposed one)
        n -= size
    return out


def best_subtree(parents: list[int], values: list[float], k: int) -> list[int]:
    """Nodes (ascending, root 0 first) of the root-connected subtree of at most k nodes with the
    largest Σ values. parents[0] == -1 and parents[i] < i (node order is topological)."""
    return Pruning(parents, values, k).nodes(k)


class Pruning:
    """The knapsack solved once for every size up to k, so a caller can weigh each compiled verify
    width against its cost (`value(j)`) and then take that width's subtree (`nodes(j)`).

    When values never increase along a path — path values, the product of chances in [0, 1]: every
    tree a step drafts, retrieves or batches — the best j-subtree is simply the j highest values
    (ties to the lower node, so a parent comes before its child): any j-set sums to no more, and that
    one is root-connected. The step takes this sort; the tree knapsack stays for general values."""

    def __init__(self, parents: list[int], values: list[float], k: int):
        n = len(parents)
        self.k = k = max(1, min(k, n))
        self.order: list[int] | None = None  # the nodes by value, when values decrease along paths
        if values[0] >= 0 and all(0 <= values[v] <= values[parents[v]] for v in range(1, n)):
            self.order = sorted(range(n), key=lambda v: (-values[v], v))[:k]
            self.root = [float("-inf")] + list(itertools.accumulate(values[v] for v in self.order))
            return
        self.children: list[list[int]] = [[] for _ in range(n)]
        for v in range(1, n):
            self.children[parents[v]].append(v)
        # best[u][j]: the best value of j nodes; split[u][i][j]: nodes given to child i when u's
        # table held j nodes after merging it (0 = child left out)
        best: list[list[float]] = [[]] * n
        self.split: list[list[list[int]]] = [[]] * n
        for u in range(n - 1, -1, -1):
            table = [float("-inf"), values[u]]  # index = node count
            steps = []
            for c in self.children[u]:
                child = best[c]
                size = min(k, len(table) - 1 + len(child) - 1)
                merged = table + [float("-inf")] * (size + 1 - len(table))
                take = [0] * (size + 1)
                for a in range(1, len(table)):
                    if table[a] == float("-inf"):
                        continue
                    for b in range(1, min(len(child) - 1, size - a) + 1):
                        value = table[a] + child[b]
                        if value > merged[a + b]:
                            merged[a + b], take[a + b] = value, b
                table = merged
                steps.append(take)
            best[u], self.split[u] = table, steps
        self.root = best[0]

    def _size(self, j: int) -> int:
        """The best node count ≤ j (ties: the smaller tree)."""
        j = max(1, min(j, len(self.root) - 1))
        if self.order is not None:  # sums of values ≥ 0 in decreasing order: the smaller tree of an equal sum
            while j > 1 and self.root[j - 1] == self.root[j]:
                j -= 1
            return j
        return max(range(1, j + 1), key=lambda m: (self.root[m], -m))

    def value(self, j: int) -> float:
        """E[A] of the best subtree of at most j nodes."""
        return self.root[self._size(j)]

    def nodes(self, j: int) -> list[int]:
        if self.order is not None:
            return sorted(self.order[: self._size(j)])
        chosen: list[int] = []
        _collect(0, self._size(j), self.children, self.split, chosen)
        return sorted(chosen)


def _collect(u: int, j: int, children: list[list[int]], split: list[list[list[int]]], out: list[int]) -> None:
    out.append(u)
    for i in range(len(children[u]) - 1, -1, -1):  # undo the merges from the last child back
        b = split[u][i][j] if j < len(split[u][i]) else 0
        if b:
            _collect(children[u][i], b, children, split, out)
            j -= b


def expected_accepted(values: list[float], nodes: list[int]) -> float:
    """E[A] of verifying `nodes` (tokens per step, bonus included)."""
    return sum(values[v] for v in nodes)
