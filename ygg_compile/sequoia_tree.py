"""Sequoia's tree search: the static tree with the largest E[A] for a node budget and a depth.

With a per-rank acceptance vector p (p[i] = probability that the target's token is the drafter's
rank-i candidate, measured on calibration text), a node reached by ranks r1..rd is accepted with
probability p[r1]·…·p[rd], so E[A](tree) = Σ over nodes of that product (the root counts 1).
c(n, d), the best E[A] of n nodes within depth d, follows by giving the n − 1 non-root nodes to the
root's children rank by rank: child i with s nodes contributes p[i]·c(s, d − 1).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StaticTree:
    parents: tuple[int, ...]  # parents[0] == -1; node order is topological
    ranks: tuple[int, ...]  # rank (0-based) of each node among its siblings' draft candidates; root 0
    expected_accepted: float

    @property
    def depth(self) -> int:
        depth = [0] * len(self.parents)
        for v in range(1, len(self.parents)):
            depth[v] = depth[self.parents[v]] + 1
        return max(depth)


def optimal_tree(p: list[float], budget: int, max_depth: int) -> StaticTree:
    """The E[A]-maximal tree of at most `budget` nodes (root included) and depth ≤ max_depth."""
    return SequoiaTables(p, budget, max_depth).tree(budget, max_depth)


class SequoiaTables:
    """The DP solved once up to a budget and a depth, so every smaller (budget, depth) is a lookup.

    c[d][n]: the best E[A] of n nodes within depth d; G[d][i][m]: the best Σ p[j]·c[d-1][s_j] over
    children of rank ≥ i sharing m nodes. Bottom-up, so deep budgets need no recursion.
    """

    def __init__(self, p: list[float], budget: int, max_depth: int):
        self.p, self.budget, self.ranks = list(p), max(1, budget), len(p)
        budget, ranks = self.budget, self.ranks
        self.c = [[0.0] + [1.0] * budget]
        self.G: list[list[list[float]]] = [[]]
        for d in range(1, max_depth + 1):
            g = [[0.0] * budget for _ in range(ranks + 1)]
            for i in range(ranks - 1, -1, -1):
                for m in range(1, budget):
                    best = g[i + 1][m]
                    for s in range(1, m + 1):
                        best = max(best, p[i] * self.c[d - 1][s] + g[i + 1][m - s])
                    g[i][m] = best
            self.G.append(g)
            self.c.append([0.0] + [1.0 + g[0][n - 1] for n in range(1, budget + 1)])

    def tree(self, budget: int, depth: int) -> StaticTree:
        """The best tree of at most `budget` nodes within `depth` (a bigger one only if it helps)."""
        c, p = self.c, self.p
        n = max(range(1, min(budget, self.budget) + 1), key=lambda b: (c[depth][b], -b))
        parents: list[int] = []
        rks: list[int] = []

        def build(n: int, d: int, parent: int, rank: int) -> None:
            node = len(parents)
            parents.append(parent)
            rks.append(rank)
            m, i = n - 1, 0
            while d > 0 and m > 0 and i < self.ranks:
                g = self.G[d]
                if g[i][m] == g[i + 1][m]:
                    i += 1
                    continue
                s = next(s for s in range(1, m + 1) if p[i] * c[d - 1][s] + g[i + 1][m - s] == g[i][m])
                build(s, d - 1, node, i)
                m, i = m - s, i + 1

        build(n, depth, -1, 0)
        return StaticTree(tuple(parents), tuple(rks), c[depth][n])
