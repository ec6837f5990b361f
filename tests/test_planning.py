"""The tree-shape optimisers against brute force: verification pruning and Sequoia's DP."""

import itertools
import random

import pytest

from ygg_compile.sequoia_tree import optimal_tree
from ygg_runtime.prune import best_subtree, expected_accepted


def random_tree(rng: random.Random, n: int, decreasing: bool) -> tuple[list[int], list[float]]:
    parents, values = [-1], [1.0]
    for v in range(1, n):
        p = rng.randrange(v)
        parents.append(p)
        values.append(values[p] * rng.random() if decreasing else rng.random())
    return parents, values


def brute_force(parents: list[int], values: list[float], k: int) -> float:
    n, best = len(parents), float("-inf")
    for size in range(1, k + 1):
        for rest in itertools.combinations(range(1, n), size - 1):
            chosen = {0, *rest}
            if all(parents[v] in chosen for v in rest):
                best = max(best, sum(values[v] for v in chosen))
    return best


def test_pruning_finds_the_best_root_connected_subtree_on_random_trees():
    rng = random.Random(0)
    for trial in range(300):
        n = rng.randint(1, 10)
        parents, values = random_tree(rng, n, decreasing=False)
        k = rng.randint(1, n)
        nodes = best_subtree(parents, values, k)
        assert nodes[0] == 0 and len(nodes) <= k
        assert all(parents[v] in nodes for v in nodes[1:]), (parents, nodes)
        assert expected_accepted(values, nodes) == pytest.approx(brute_force(parents, values, k)), trial


def test_pruning_equals_top_k_by_value_when_values_decrease_along_paths():
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randint(2, 60)
        parents, values = random_tree(rng, n, decreasing=True)
        k = rng.randint(1, n)
        top = sorted(range(n), key=lambda v: -values[v])[:k]
        assert expected_accepted(values, best_subtree(parents, values, k)) == pytest.approx(expected_accepted(values, top))


def complete_tree(p: list[float], depth: int) -> tuple[list[int], list[float], list[int]]:
    """Every rank under every node down to `depth`: the space Sequoia searches."""
    parents, values, depths = [-1], [1.0], [0]
    frontier = [0]
    for _ in range(depth):
        nxt = []
        for u in frontier:
            for r, pr in enumerate(p):
                parents.append(u)
                values.append(values[u] * pr)
                depths.append(depths[u] + 1)
                nxt.append(len(parents) - 1)
        frontier = nxt
    return parents, values, depths


def test_sequoia_dp_matches_brute_force_on_small_budgets():
    rng = random.Random(2)
    for _ in range(60):
        ranks, depth = rng.randint(1, 3), rng.randint(1, 3)
        p = sorted((rng.random() * 0.6 for _ in range(ranks)), reverse=rng.random() < 0.7)
        parents, values, _ = complete_tree(p, depth)
        budget = rng.randint(1, min(7, len(parents)))
        tree = optimal_tree(p, budget, depth)
        assert tree.expected_accepted == pytest.approx(brute_force(parents, values, budget))
        assert len(tree.parents) <= budget and tree.depth <= depth
        # the tree it returns is worth what it claims
        worth = [1.0]
        for v in range(1, len(tree.parents)):
            worth.append(worth[tree.parents[v]] * p[tree.ranks[v]])
        assert sum(worth) == pytest.approx(tree.expected_accepted)
        assert len({(tree.parents[v], tree.ranks[v]) for v in range(1, len(tree.parents))}) == len(tree.parents) - 1


def test_sequoia_dp_agrees_with_pruning_the_complete_tree():
    p = [0.55, 0.2, 0.1, 0.05]
    parents, values, _ = complete_tree(p, 3)
    for budget in (1, 2, 4, 8, 16, 32):
        tree = optimal_tree(p, budget, 3)
        assert tree.expected_accepted == pytest.approx(expected_accepted(values, best_subtree(parents, values, budget)))
